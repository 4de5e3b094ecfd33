"""CIFAR-10 training with Hugging Face Accelerate: one plain PyTorch loop, in fp32, fp16 or bf16."""

__version__ = "0.1.0"
