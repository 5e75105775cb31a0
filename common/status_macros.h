// Status propagation macros. Debian's Abseil ships absl::Status but not its macros, so Strata
// defines them once, here.
//
//   STRATA_RETURN_IF_ERROR(expr);             // expr is absl::Status; returns it when not OK.
//   STRATA_ASSIGN_OR_RETURN(lhs, expr);       // expr is absl::StatusOr<T>; on OK moves the
//                                             // value into lhs (a declaration or an lvalue),
//                                             // otherwise returns the status.
//
// Both evaluate expr exactly once and work in any function returning absl::Status or
// absl::StatusOr<U>.
#pragma once

#include <utility>

#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define STRATA_STATUS_CONCAT_INNER_(a, b) a##b
#define STRATA_STATUS_CONCAT_(a, b) STRATA_STATUS_CONCAT_INNER_(a, b)

#define STRATA_RETURN_IF_ERROR(expr)                                     \
  do {                                                                   \
    ::absl::Status strata_status_ = (expr);                              \
    if (ABSL_PREDICT_FALSE(!strata_status_.ok())) return strata_status_; \
  } while (false)

#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_STATUS_CONCAT_(strata_statusor_, __LINE__), lhs, expr)

#define STRATA_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)                     \
  auto statusor = (expr);                                                      \
  if (ABSL_PREDICT_FALSE(!statusor.ok())) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()
