"""Math only: the target adapter, drafters, training-time-test unroll, decoding and metrics.

Nothing here reads pipeline artifacts or configs; every function takes plain arguments.
"""
