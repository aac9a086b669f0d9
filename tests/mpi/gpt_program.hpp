#pragma once
// The training tests check the GPT example's own model.
#include "../../examples/gpt/model.hpp"

namespace gpt_testing = gpt_model;
