"""Ray example: trainer and inference workers as Ray actors refitting through refitd.

ray.init(num_cpus=2, include_dashboard=False)
rows = run("127.0.0.1:50151", refits=3)      # with `refitd serve --cpu-slots 2` running
"""

from clients.ray_example.actors import InferenceActor, TrainerActor, run, weights

__all__ = ["InferenceActor", "TrainerActor", "run", "weights"]
