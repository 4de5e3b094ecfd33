"""CIFAR-10 training with Hugging Face Accelerate: one plain PyTorch loop, in fp32, fp16 or bf16."""

from cifar_accel.inference import TrainedModel, load_model

__version__ = "0.1.0"
__all__ = ["TrainedModel", "load_model"]
