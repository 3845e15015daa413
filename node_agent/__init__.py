"""loraplex.node_agent"""
