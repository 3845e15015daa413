"""loraplex.operator"""
