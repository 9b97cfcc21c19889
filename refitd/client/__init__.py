"""refitd.client"""
