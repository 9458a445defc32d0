"""Intra-op thread counts per thread: how the host thread gets many and an emulated GPU gets one.

What torch's ``set_num_threads`` does here (torch 2.13, OpenMP build, as the Linux CPU and CUDA
wheels are; ``tests/test_host_threads.py`` holds it): it sets the calling thread's own OpenMP count
*and* the process default, and a thread takes the process default when it first runs an intra-op
parallel operation (or asks ``get_num_threads``) -- also when it had called ``set_num_threads``
before that. So a thread that sets 1 and then waits while another thread sets 4 later runs its
first parallel kernel with 4. A thread's own count sticks only once the thread has been initialised:
``own_intra_op_threads`` initialises first, then sets. The process default is then whatever the last
caller set, for threads that have not run a parallel operation yet.
"""

from __future__ import annotations

import torch


def own_intra_op_threads(n: int) -> None:
    """Run the calling thread's intra-op parallel work (elementwise kernels, reductions, matmuls)
    on ``n`` threads, whatever other threads set later. Call it on the thread itself."""
    torch.get_num_threads()  # initialise from the process default now, not at the first kernel
    torch.set_num_threads(n)
