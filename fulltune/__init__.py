"""fulltune: declarative full-parameter fine-tuning pipelines that fit the hardware you have."""

__version__ = "0.1.0"
