// The op's argument list: one string for every library that defines an op with the
// op's exact schema (the product's `tree_attn`, the test simulator's `tree_attn_sim`).
#pragma once

#define TREE_ATTN_SCHEMA_ARGS                                                          \
  "(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor? mask_offset=None, " \
  "float? scale=None, float? softcap=None, Tensor? sinks=None)"
