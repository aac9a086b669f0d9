#pragma once
/// @file
/// @brief The MPI library's collective settings in force on this rank, read through the MPI
/// tool information interface (MPI_T control variables), for the settings agreement before
/// step 1 (train/agreement.hpp).
///
/// Ranks whose collectives use different algorithms (Open MPI's `coll_libnbc_ibcast_algorithm`
/// set on one rank only, say) deadlock in the first collective that differs or receive
/// truncated messages; the library's own collectives, and the control path's, are all made of
/// them. Every control variable of the collective framework is compared, whatever set it
/// (an environment variable, `mpirun --mca`, a parameter file), its verbosity aside.
///
/// @code
/// for (const auto& [name, value] : runtime::mpi::collective_settings()) std::printf("%s = %s\n", name.c_str(), value.c_str());
/// @endcode

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

extern char** environ;

namespace concerto::runtime::detail {

// A control variable's value as text: a string, or an integer of the variable's size.
inline std::string cvar_text(MPI_Datatype type, const std::vector<char>& bytes) {
  if (type == MPI_CHAR) return std::string(bytes.data(), ::strnlen(bytes.data(), bytes.size()));
  if (type == MPI_DOUBLE) {
    double v = 0;
    std::memcpy(&v, bytes.data(), sizeof v);
    return std::to_string(v);
  }
  int size = 0;
  MPI_Type_size(type, &size);
  std::int64_t v = 0;
  if (size == 1) v = static_cast<unsigned char>(bytes[0]);
  else if (size == 2) { std::int16_t x = 0; std::memcpy(&x, bytes.data(), 2); v = x; }
  else if (size == 4) { std::int32_t x = 0; std::memcpy(&x, bytes.data(), 4); v = x; }
  else if (size == 8) std::memcpy(&v, bytes.data(), 8);
  return std::to_string(v);
}

// The collective framework's variables: "coll", "coll_<component>_<name>" (Open MPI), verbosity
// aside; and MPICH's "MPIR_CVAR_<collective>_..." algorithm choices.
inline bool collective_variable(std::string_view name) {
  if (name.ends_with("_verbose") || name.ends_with("_verbosity")) return false;
  if (name == "coll" || name.starts_with("coll_")) return true;
  return name.starts_with("MPIR_CVAR_") && name.find("ALGORITHM") != std::string_view::npos;
}

} // namespace concerto::runtime::detail

namespace concerto::runtime::mpi {

/// @brief Name and value of every collective setting in force, sorted by name. Where the MPI
/// library offers no tool interface, the environment's OMPI_MCA_coll* variables stand in.
[[nodiscard]] inline std::vector<std::pair<std::string, std::string>> collective_settings() {
  std::vector<std::pair<std::string, std::string>> out;
  int provided = 0;
  if (MPI_T_init_thread(MPI_THREAD_SINGLE, &provided) == MPI_SUCCESS) {
    int n = 0;
    MPI_T_cvar_get_num(&n);
    for (int i = 0; i < n; ++i) {
      char name[256];
      int name_len = sizeof name, verbosity = 0, bind = 0, scope = 0, desc_len = 0;
      MPI_Datatype type = MPI_DATATYPE_NULL;
      MPI_T_enum enumtype = MPI_T_ENUM_NULL;
      if (MPI_T_cvar_get_info(i, name, &name_len, &verbosity, &type, &enumtype, nullptr, &desc_len, &bind, &scope) != MPI_SUCCESS)
        continue;
      if (bind != MPI_T_BIND_NO_OBJECT || !detail::collective_variable(name)) continue;
      MPI_T_cvar_handle handle = MPI_T_CVAR_HANDLE_NULL;
      int count = 0;
      if (MPI_T_cvar_handle_alloc(i, nullptr, &handle, &count) != MPI_SUCCESS) continue;
      int size = 0;
      MPI_Type_size(type, &size);
      std::vector<char> bytes(static_cast<std::size_t>(std::max(count, 1)) * static_cast<std::size_t>(std::max(size, 1)) + 1, 0);
      if (MPI_T_cvar_read(handle, bytes.data()) == MPI_SUCCESS) out.emplace_back(name, detail::cvar_text(type, bytes));
      MPI_T_cvar_handle_free(&handle);
    }
    MPI_T_finalize();
  }
  if (out.empty())
    for (char** e = environ; *e != nullptr; ++e)
      if (std::string_view entry(*e); entry.starts_with("OMPI_MCA_coll")) {
        const auto eq = entry.find('=');
        out.emplace_back(std::string(entry.substr(0, eq)), eq == std::string_view::npos ? "" : std::string(entry.substr(eq + 1)));
      }
  std::sort(out.begin(), out.end());
  return out;
}

} // namespace concerto::runtime::mpi
