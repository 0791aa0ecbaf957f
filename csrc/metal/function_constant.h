// Metal function constants (MSL `constant T name [[function_constant(i)]];`): the values a
// launch's pipeline is specialised with, in portable C++. The MPS host hands them to Metal as
// MTLFunctionConstantValues when it creates the pipeline (csrc/metal/pipeline_cache.mm); the
// simulator (tests/sim) reads them at run time. A kernel name plus its constant values
// identifies one pipeline.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace tree_attn {

// The scalar types a function constant may have here (MSL allows vectors and 64-bit types
// too; the project's kernels need none of them, so both backends refuse them).
enum class FunctionConstantType : uint8_t { Bool, Char, UChar, Short, UShort, Int, UInt, Half, Float };

constexpr const char* function_constant_type_name(FunctionConstantType t) {
  switch (t) {
    case FunctionConstantType::Bool: return "bool";
    case FunctionConstantType::Char: return "char";
    case FunctionConstantType::UChar: return "uchar";
    case FunctionConstantType::Short: return "short";
    case FunctionConstantType::UShort: return "ushort";
    case FunctionConstantType::Int: return "int";
    case FunctionConstantType::UInt: return "uint";
    case FunctionConstantType::Half: return "half";
    case FunctionConstantType::Float: return "float";
  }
  return "?";
}

constexpr size_t function_constant_type_size(FunctionConstantType t) {
  switch (t) {
    case FunctionConstantType::Bool:
    case FunctionConstantType::Char:
    case FunctionConstantType::UChar: return 1;
    case FunctionConstantType::Short:
    case FunctionConstantType::UShort:
    case FunctionConstantType::Half: return 2;
    case FunctionConstantType::Int:
    case FunctionConstantType::UInt:
    case FunctionConstantType::Float: return 4;
  }
  return 0;
}

struct FunctionConstant {
  uint32_t index = 0;  // [[function_constant(index)]]
  FunctionConstantType type = FunctionConstantType::UInt;
  // The value in its type's own representation (the first function_constant_type_size(type)
  // bytes; a half is its IEEE binary16 bits), as Metal's setConstantValue:type:atIndex: reads it.
  alignas(8) unsigned char bytes[8] = {};

  const void* data() const { return bytes; }

  static FunctionConstant of_bool(uint32_t index, bool v) { return make(index, FunctionConstantType::Bool, v); }
  static FunctionConstant of_int(uint32_t index, int32_t v) { return make(index, FunctionConstantType::Int, v); }
  static FunctionConstant of_uint(uint32_t index, uint32_t v) { return make(index, FunctionConstantType::UInt, v); }
  static FunctionConstant of_short(uint32_t index, int16_t v) { return make(index, FunctionConstantType::Short, v); }
  static FunctionConstant of_ushort(uint32_t index, uint16_t v) { return make(index, FunctionConstantType::UShort, v); }
  static FunctionConstant of_float(uint32_t index, float v) { return make(index, FunctionConstantType::Float, v); }
  static FunctionConstant of_half_bits(uint32_t index, uint16_t bits) {
    return make(index, FunctionConstantType::Half, bits);
  }

  friend bool operator==(const FunctionConstant& a, const FunctionConstant& b) {
    return a.index == b.index && a.type == b.type && std::memcmp(a.bytes, b.bytes, sizeof a.bytes) == 0;
  }

 private:
  template <class T> static FunctionConstant make(uint32_t index, FunctionConstantType type, T v) {
    static_assert(sizeof(T) <= sizeof(bytes));
    FunctionConstant c;
    c.index = index;
    c.type = type;
    std::memcpy(c.bytes, &v, sizeof(T));
    return c;
  }
};

// A text key of a pipeline: the kernel name and every constant (index, type, bytes), in the
// order given. Two launches share a pipeline exactly when their keys are equal.
inline std::string pipeline_key(const std::string& kernel, const std::vector<FunctionConstant>& constants) {
  std::string key = kernel;
  static constexpr char kHex[] = "0123456789abcdef";
  for (const FunctionConstant& c : constants) {
    key += '|';
    key += std::to_string(c.index);
    key += ':';
    key += function_constant_type_name(c.type);
    key += '=';
    for (size_t i = 0; i < function_constant_type_size(c.type); ++i) {
      key += kHex[c.bytes[i] >> 4];
      key += kHex[c.bytes[i] & 15];
    }
  }
  return key;
}

}  // namespace tree_attn
