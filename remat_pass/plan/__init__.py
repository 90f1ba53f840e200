"""Planning: the schedule (layer level or op level) that recomputes least under a peak budget, for one graph or for all graphs of a step, checked by liveness."""
