"""refitd.agent"""
