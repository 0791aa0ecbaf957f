"""torch_tree_attn_sim: the Metal Shading Language simulator, test apparatus of
torch-tree-attn (never installed by the product's install).

Importing it registers ``torch.ops.tree_attn_sim.*`` on CPU tensors:

- ``forward`` / ``forward_with_lse``: the product op's exact schema, computed by the real
  shaders in ``shaders/*.metal`` under the launch plan the MPS backend encodes;
- ``launch_plan`` / ``traffic``: that plan and its traffic model, as JSON;
- ``launch`` / ``launch_counters`` / ``kernels``: the raw simulator, for its own tests
  (``launch`` returns [device bytes read, written], ``launch_counters`` every counter of the
  launch as a dict; both take function-constant values as ``"index:type=value"`` strings).
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the operators)
