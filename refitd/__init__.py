"""refitd: move RL trainer weights to inference servers, resharding them on the way."""

__version__ = "0.1.0"
