"""loraplex.server"""
