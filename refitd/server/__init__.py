"""refitd.server"""
