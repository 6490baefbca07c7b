"""Control loops: the batch gate, the autoscaler and its actuators, the health prober, the canary
controller."""
