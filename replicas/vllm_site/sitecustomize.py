"""Imported at the start of every Python process of a vLLM replica that :mod:`replicas.launcher`
starts (its directory leads ``PYTHONPATH``): asks Linux for the AMX tile state.

On x86 CPUs with AMX, vLLM's CPU attention (``cpu_attention_with_kv_cache``, its ``amx`` kernel
for bfloat16) runs AMX instructions in the engine's worker process without asking the kernel for
the tile state first (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), so the worker dies
of SIGILL unless something else in it asked first -- oneDNN does when it picks AMX for a large
enough matmul, which a long first prompt triggers and a short one does not. Asking is harmless
where AMX is absent (the call fails and nothing changes) and does nothing on other systems.
"""

import contextlib
import ctypes
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

if sys.platform == "linux" and platform.machine() == "x86_64":
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
