// TensorView<T, Rank>: a non-owning, strided view of a Rank-dimensional array of T.
//
// Shapes and strides are in elements (not bytes); strides may be any non-negative values, so a
// view can describe a slice, a transpose or a broadcast (stride 0) without copying. The view
// never owns its data; whoever created the buffer keeps it alive. Index bounds are checked with
// STRATA_DCHECK (debug builds). Views are cheap to copy and thread-compatible.
//
//   float* kv = ...;                               // [tokens, kv_heads, head_dim]
//   TensorView<float, 3> k(kv, {tokens, heads, dim});
//   TensorView<float, 2> head0 = k.Select(1, 0);   // [tokens, head_dim], stride heads*dim
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/check.h"

namespace strata {

template <typename T, int Rank>
class TensorView {
  static_assert(Rank >= 1, "TensorView needs at least one dimension");

 public:
  using Index = int64_t;
  using Shape = std::array<Index, Rank>;

  TensorView() = default;

  // Contiguous, row-major (last dimension fastest).
  TensorView(T* data, const Shape& shape) : data_(data), shape_(shape) {
    Index s = 1;
    for (int d = Rank - 1; d >= 0; --d) {
      STRATA_DCHECK(shape[d] >= 0, "negative extent");
      strides_[d] = s;
      s *= shape[d];
    }
  }

  TensorView(T* data, const Shape& shape, const Shape& strides)
      : data_(data), shape_(shape), strides_(strides) {
    for (int d = 0; d < Rank; ++d) {
      STRATA_DCHECK(shape[d] >= 0 && strides[d] >= 0, "negative extent or stride");
    }
  }

  // A view of T converts to a view of const T.
  template <typename U,
            typename = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  TensorView(const TensorView<U, Rank>& other)  // NOLINT(google-explicit-constructor)
      : data_(other.data()), shape_(other.shape()), strides_(other.strides()) {}

  T* data() const { return data_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  Index size(int dim) const { return shape_[dim]; }
  Index stride(int dim) const { return strides_[dim]; }

  Index numel() const {
    Index n = 1;
    for (Index e : shape_) n *= e;
    return n;
  }

  bool empty() const { return numel() == 0; }

  // True when the view is dense and row-major (size-1 dimensions may have any stride).
  bool is_contiguous() const {
    Index expected = 1;
    for (int d = Rank - 1; d >= 0; --d) {
      if (shape_[d] != 1 && strides_[d] != expected) return false;
      expected *= shape_[d];
    }
    return true;
  }

  template <typename... Is>
  T& operator()(Is... idx) const {
    static_assert(sizeof...(Is) == Rank, "wrong number of indices");
    const std::array<Index, Rank> i{static_cast<Index>(idx)...};
    Index off = 0;
    for (int d = 0; d < Rank; ++d) {
      STRATA_DCHECK(i[d] >= 0 && i[d] < shape_[d], "index out of bounds");
      off += i[d] * strides_[d];
    }
    return data_[off];
  }

  // Fixes dimension `dim` at `index`; the result has one dimension fewer.
  auto Select(int dim, Index index) const {
    static_assert(Rank >= 2, "Select on a 1-D view; use operator()");
    STRATA_DCHECK(dim >= 0 && dim < Rank, "dimension out of range");
    STRATA_DCHECK(index >= 0 && index < shape_[dim], "index out of bounds");
    std::array<Index, Rank - 1> shape{}, strides{};
    for (int d = 0, o = 0; d < Rank; ++d) {
      if (d == dim) continue;
      shape[o] = shape_[d];
      strides[o] = strides_[d];
      ++o;
    }
    return TensorView<T, Rank - 1>(data_ + index * strides_[dim], shape, strides);
  }

  // Elements [begin, end) of dimension `dim`.
  TensorView Slice(int dim, Index begin, Index end) const {
    STRATA_DCHECK(dim >= 0 && dim < Rank, "dimension out of range");
    STRATA_DCHECK(0 <= begin && begin <= end && end <= shape_[dim], "slice out of bounds");
    Shape shape = shape_;
    shape[dim] = end - begin;
    return TensorView(data_ + begin * strides_[dim], shape, strides_);
  }

  // Swaps two dimensions (no data moves).
  TensorView Transpose(int a, int b) const {
    STRATA_DCHECK(a >= 0 && a < Rank && b >= 0 && b < Rank, "dimension out of range");
    Shape shape = shape_, strides = strides_;
    std::swap(shape[a], shape[b]);
    std::swap(strides[a], strides[b]);
    return TensorView(data_, shape, strides);
  }

 private:
  T* data_ = nullptr;
  Shape shape_{};
  Shape strides_{};
};

}  // namespace strata
