// What every GPU benchmark records about its run, and where it writes its results: the device,
// its multiprocessors, the driver, the date (UTC) and the commit ($STRATA_COMMIT).
//
//   const GpuRunInfo info = CollectGpuRunInfo(prop, driver);
//   txt << info.Header("cuda_model_bench") << "\n";
//   const std::string base = info.ResultBase(out_dir, "cuda_model_bench");  // + ".txt", ".json"
//   json << "{" << info.JsonFields() << ", ...";
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"

namespace strata::bench {

struct GpuRunInfo {
  std::string device;  // cudaDeviceProp::name
  int sms = 0;
  int driver = 0;      // cudaDriverGetVersion's
  std::string date;    // YYYY-MM-DD, UTC
  std::string commit;  // $STRATA_COMMIT, or "unknown"

  // "<bench>: <device> (<sms> SMs, driver X.Y), <date>, commit <commit>"
  std::string Header(const char* bench) const {
    return absl::StrCat(bench, ": ", device, " (", sms, " SMs, driver ", driver / 1000, ".",
                        (driver % 1000) / 10, "), ", date, ", commit ", commit);
  }
  // <out_dir>/<bench>-<device, spaces as _>-<date>-<commit>, out_dir made if missing.
  std::string ResultBase(const std::string& out_dir, const char* bench) const {
    std::filesystem::create_directories(out_dir);
    std::string name = device;
    std::replace(name.begin(), name.end(), ' ', '_');
    return absl::StrCat(out_dir, "/", bench, "-", name, "-", date, "-", commit);
  }
  // "device": ..., "driver": ..., "date": ..., "commit": ... (a JSON object's first fields)
  std::string JsonFields() const {
    return absl::StrCat("\"device\": \"", device, "\", \"driver\": ", driver, ", \"date\": \"",
                        date, "\", \"commit\": \"", commit, "\"");
  }
};

inline GpuRunInfo CollectGpuRunInfo(const cudaDeviceProp& prop, int driver) {
  GpuRunInfo info;
  info.device = prop.name;
  info.sms = prop.multiProcessorCount;
  info.driver = driver;
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  info.date = date;
  const char* commit = std::getenv("STRATA_COMMIT");
  info.commit = commit != nullptr ? commit : "unknown";
  return info;
}

}  // namespace strata::bench
