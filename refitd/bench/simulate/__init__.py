"""`refitd bench simulate`: the command and the flow-level link model it replays plans on."""
