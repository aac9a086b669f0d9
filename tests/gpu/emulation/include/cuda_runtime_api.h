#pragma once
// Stands in for the CUDA Toolkit's cuda_runtime_api.h in the emulated test targets (see ../cuda_emulation.hpp).
#include "../cuda_emulation.hpp"
