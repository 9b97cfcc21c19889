"""refitd.cli"""
