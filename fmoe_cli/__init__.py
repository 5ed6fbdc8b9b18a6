"""fmoe: chat with a Mixture-of-Experts LLM on a GPU that cannot hold it."""

__version__ = "0.1.0"
