"""loraplex.kernels"""
