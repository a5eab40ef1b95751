"""Log messages a user can do nothing about, dropped at the logger that emits them.

Each entry names one library logger and the start of one message; everything else those loggers say
(real warnings included) still reaches the log. Installed in the CLI process, the flow and the
trainer's child (`quiet_known_noise`, idempotent).
"""

from __future__ import annotations

import logging

# logger name → the messages of that logger to drop (matched by substring: accelerate prefixes "[RANK n] ").
KNOWN_NOISE: dict[str, tuple[str, ...]] = {
    # Tied input and output embeddings share one tensor; safetensors stores it once and `from_pretrained`
    # ties it again from the config (the resume tests compare reloaded weights bit for bit).
    "accelerate.utils.other": ("Removed shared tensor",),
    # A local checkpoint directory has no hub model card or license to copy into the logged model.
    "mlflow.transformers": ("The model card could not be retrieved from the hub",
                            "Unable to find license information for this model"),
    # System metrics on a machine without a GPU: CPU and memory are still logged. The monitor's start and stop
    # lines say nothing the run's own lines do not.
    "mlflow.system_metrics.system_metrics_monitor": ("Skip logging GPU metrics", "Started monitoring system metrics",
                                                     "Stopping system metrics monitoring",
                                                     "Successfully terminated system metrics monitoring"),
    # torchao (float8 training) tries its prebuilt kernels for other Python versions and GPU architectures on import.
    "torchao": ("Failed to load ",),
    # torchao 0.18 registers its enums with torch.compile the way torch 2.13 deprecates.
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
}


class _DropKnownNoise(logging.Filter):
    def __init__(self, messages: tuple[str, ...]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in self.messages)


def quiet_known_noise() -> None:
    """Install the KNOWN_NOISE filters (once per logger)."""
    for name, messages in KNOWN_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in logger.filters):
            logger.addFilter(_DropKnownNoise(messages))
