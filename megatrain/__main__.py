import os

# Every system's CUDA caching allocator maps its blocks in expandable segments (unless the user set the allocator):
# an eager Qwen2.5-14B micro-batch of 96 on an H200 ran out of GPU memory with 121 GiB allocated and 16.5 GiB reserved
# but unusable (fragments beside 2.5 GiB activations), inside what its plan had counted. Read when CUDA first
# allocates, so set before any command runs; bench records it (env.cuda_alloc_conf).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from megatrain.cli import exit_process, main  # noqa: E402

exit_process(main())
