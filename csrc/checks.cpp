// Message text, argument checks and checked layout arithmetic (sdcp.h).

#include "sdcp.h"

#include <cstdio>

namespace sdcp {

Text& Text::operator<<(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  s_ += buf;
  return *this;
}

Text& Text::operator<<(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  s_ += buf;
  return *this;
}

Text& Text::operator<<(c10::IntArrayRef a) {
  s_ += '[';
  for (size_t i = 0; i < a.size(); ++i) {
    if (i) s_ += ", ";
    s_ += std::to_string(a[i]);
  }
  s_ += ']';
  return *this;
}

std::string shape_str(const at::Tensor& t) { return cat(t.sizes()); }

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType want) {
  SDCP_CHECK_ARG(t.scalar_type() == want, name, "dtype " << want, "dtype " << t.scalar_type());
}

void check_float_dtype(const at::Tensor& t, const char* name) {
  auto st = t.scalar_type();
  SDCP_CHECK_ARG(st == at::kBFloat16 || st == at::kHalf || st == at::kFloat, name,
                 "dtype bfloat16, float16 or float32", "dtype " << st);
}

void check_dim(const at::Tensor& t, const char* name, int64_t dim) {
  SDCP_CHECK_ARG(t.dim() == dim, name, dim << " dimensions", t.dim() << " (shape " << t.sizes() << ")");
}

void check_size(const at::Tensor& t, const char* name, int64_t d, int64_t want) {
  SDCP_CHECK_ARG(t.size(d) == want, name, "size " << want << " at dim " << d,
                 t.size(d) << " (shape " << t.sizes() << ")");
}

void check_call_tag(int64_t tag) {
  SDCP_CHECK_ARG(tag == -1 || (tag >= 0 && tag < kCallTagLimit), "tag",
                 "-1 (untagged) or an int in [0, " << kCallTagLimit << ")", tag);
}

void check_contiguous(const at::Tensor& t, const char* name) {
  SDCP_CHECK_ARG(t.is_contiguous(), name, "a contiguous tensor",
                 "strides " << t.strides() << " for shape " << t.sizes());
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref,
                       const char* ref_name) {
  SDCP_CHECK_ARG(t.device() == ref.device(), name, "device " << ref.device() << " (that of '" << ref_name << "')",
                 "device " << t.device());
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

int64_t checked_mul(std::initializer_list<int64_t> factors, const char* arg) {
  int64_t product = 1;
  for (int64_t f : factors) {
    TORCH_CHECK_VALUE(f >= 0, cat("torch_sdcp: argument '", arg, "': expected sizes >= 0, got a factor ", f));
    TORCH_CHECK_VALUE(!__builtin_mul_overflow(product, f, &product) && product <= kMaxRegionBytes,
                      cat("torch_sdcp: argument '", arg, "': expected a workspace region of at most ",
                          kMaxRegionBytes, " bytes per rank, got a size that exceeds it (a factor of ", f, ")"));
  }
  return product;
}

int64_t align_up(int64_t x, int64_t a) {
  TORCH_CHECK_VALUE(x >= 0 && x <= kMaxRegionBytes, cat("torch_sdcp: internal: size ", x, " out of range"));
  return (x + a - 1) / a * a;
}

void check_params(const std::vector<int64_t>& p, size_t n, const char* what) {
  TORCH_CHECK_VALUE(p.size() == n, cat("torch_sdcp: argument 'params': expected ", n, " values (", what,
                    "), got ", p.size()));
  for (size_t i = 0; i < p.size(); ++i)
    TORCH_CHECK_VALUE(p[i] > 0, cat("torch_sdcp: argument 'params': expected positive values (", what,
                      "), got ", p[i], " at position ", i));
}

}  // namespace sdcp
