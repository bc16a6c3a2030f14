"""One-off investigations behind a choice in docs/design.md, each run as `python -m bench.lab.X` with its JSON
result in bench/results/: width_invariance (why 8da4w_draft), draft_vocab (the draft vocabulary size), kernel_tune
(the kernels' launch configurations and profiles), sass (what ptxas made of a kernel, without a GPU), ncu_int4
(the workload Nsight Compute profiles)."""
