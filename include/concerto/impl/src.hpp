#pragma once
/// @file
/// @brief The separately compiled part of concerto: include this in exactly one source file of
/// a program built with CONCERTO_SEPARATE_COMPILATION defined everywhere (CMake: link
/// `concerto::mpi_compiled`, which does both).
///
/// Header-only is the default: every trainer's translation unit then generates the code of the
/// step, the planner, the solver, the runtime and the lowering. With the macro, the headers
/// declare those as explicit instantiations made here, so a trainer's own file compiles only
/// its model (docs/training.md, "Compile time"; docs/performance.md §5 has the numbers).

#ifndef CONCERTO_SEPARATE_COMPILATION
#error "concerto/impl/src.hpp is for CONCERTO_SEPARATE_COMPILATION builds: define it in every translation unit"
#endif

#include <concerto/graph/lower.hpp>
#include <concerto/train/step.hpp>

template class concerto::train::basic_step<concerto::train::default_backend>;
template concerto::ir::graph concerto::graph::detail::lower_sized<concerto::graph::detail::lowering_size>(
    const concerto::graph::program<concerto::graph::detail::lowering_size>&, const concerto::shape_map&,
    const concerto::mesh&, const concerto::lower_options&);
template concerto::train::detail::lowered_program
concerto::train::detail::lower_for_step<concerto::graph::detail::lowering_size>(
    const concerto::graph::program<concerto::graph::detail::lowering_size>&, const concerto::shape_map&,
    const concerto::mesh&, const concerto::lower_options&);
