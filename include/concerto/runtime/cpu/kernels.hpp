#pragma once
/// @file
/// @brief All CPU compute kernels of the MPI backend, forward and backward.
///
/// Plain functions over fp32 row-major contiguous spans in `concerto::runtime::cpu`. They
/// allocate nothing: the kernels that need scratch memory take a caller-provided workspace
/// sized by a `*_workspace_floats()` function, so the executor can carve everything out of the
/// plan's memory layout once. Sizes are checked and a mismatch throws concerto::error naming
/// the kernel and the argument. Reference: docs/kernels.md.
///
/// @code
/// namespace cpu = concerto::runtime::cpu;
/// cpu::init_blas_threads(1);
/// cpu::matmul(x, w, h, rows, hidden, in, {.trans_b = true});
/// cpu::gelu(h, a);
/// @endcode

#include <concerto/runtime/cpu/attention.hpp>
#include <concerto/runtime/cpu/convolution.hpp>
#include <concerto/runtime/cpu/dropout.hpp>
#include <concerto/runtime/cpu/elementwise.hpp>
#include <concerto/runtime/cpu/embedding.hpp>
#include <concerto/runtime/cpu/loss.hpp>
#include <concerto/runtime/cpu/matmul.hpp>
#include <concerto/runtime/cpu/moe.hpp>
#include <concerto/runtime/cpu/normalization.hpp>
#include <concerto/runtime/cpu/optimizer.hpp>
#include <concerto/runtime/cpu/parts.hpp>
#include <concerto/runtime/cpu/pooling.hpp>
#include <concerto/runtime/cpu/rotary.hpp>
