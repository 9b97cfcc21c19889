"""refitd.transport"""
