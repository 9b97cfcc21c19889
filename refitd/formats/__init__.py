"""refitd.formats"""
