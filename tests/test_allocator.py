"""keep_freed_memory: the default recipe's fp32 training step stops faulting its buffers' pages in every time."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

STEPS = """
import resource, sys, torch
from cifar_accel.allocator import keep_freed_memory
from cifar_accel.models import build_model
print(keep_freed_memory())
torch.manual_seed(0)
model = build_model("simple_cnn", num_classes=10).to(memory_format=torch.channels_last)
optimizer = torch.optim.Adam(model.parameters())
inputs = torch.randn(64, 3, 32, 32).contiguous(memory_format=torch.channels_last)
labels = torch.randint(0, 10, (64,))

def step():
    torch.nn.functional.cross_entropy(model(inputs), labels).backward()
    optimizer.step()
    optimizer.zero_grad()

for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def page_faults_per_step(**environment: str) -> tuple[bool, float]:
    """Whether keep_freed_memory took effect, and the minor page faults per fp32 step of simple_cnn at batch 64,
    in a fresh process (glibc's settings are per process)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")} | environment
    out = subprocess.run([sys.executable, "-c", STEPS], env=env, capture_output=True, text=True, check=True).stdout
    kept, faults = out.split()
    return kept == "True", float(faults)


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_memory_is_kept_so_steps_do_not_fault_pages_in():
    """Without it this step faults about 10,000 pages in (40 MB) on a 2-core AMD EPYC; with it about 200."""
    kept, faults = page_faults_per_step()
    assert kept and faults < 2000


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_thresholds_set_in_the_environment_are_left_alone():
    kept, _ = page_faults_per_step(MALLOC_TRIM_THRESHOLD_="131072")
    assert not kept
