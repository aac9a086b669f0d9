// The learning-rate schedule (runtime/lr_schedule.hpp): warmup, the three decays and the floor
// against their closed forms; bad schedules refused by field.
#include <concerto/runtime/lr_schedule.hpp>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>

using namespace concerto;
using Catch::Approx;
using Catch::Matchers::ContainsSubstring;

TEST_CASE("warmup rises linearly to the rate, then each decay falls to the floor") {
  const float lr = 0.5f;
  runtime::lr_schedule s{.decay = runtime::lr_decay::cosine, .warmup_steps = 4, .decay_steps = 14, .min_ratio = 0.1f};
  s.check();
  CHECK(runtime::lr_at(s, lr, 1) == Approx(0.125));
  CHECK(runtime::lr_at(s, lr, 2) == Approx(0.25));
  CHECK(runtime::lr_at(s, lr, 4) == Approx(0.5));
  for (int t = 5; t < 14; ++t) { // floor + (lr - floor)·(1 + cos(π·p))/2
    const double p = (t - 4) / 10.0;
    CHECK(runtime::lr_at(s, lr, t) == Approx(0.05 + 0.45 * 0.5 * (1 + std::cos(M_PI * p))));
  }
  CHECK(runtime::lr_at(s, lr, 9) == Approx(0.275)); // half way: the mean of the rate and the floor
  CHECK(runtime::lr_at(s, lr, 14) == Approx(0.05));
  CHECK(runtime::lr_at(s, lr, 1000) == Approx(0.05));

  s.decay = runtime::lr_decay::linear;
  CHECK(runtime::lr_at(s, lr, 9) == Approx(0.275));
  CHECK(runtime::lr_at(s, lr, 6) == Approx(0.05 + 0.45 * 0.8));
  CHECK(runtime::lr_at(s, lr, 20) == Approx(0.05));

  s.decay = runtime::lr_decay::constant;
  CHECK(runtime::lr_at(s, lr, 3) == Approx(0.375));
  CHECK(runtime::lr_at(s, lr, 100) == lr);
  CHECK(runtime::lr_at(runtime::lr_schedule{}, lr, 1) == lr); // the default keeps the rate
  // Cosine without warmup starts at the rate.
  const runtime::lr_schedule c{.decay = runtime::lr_decay::cosine, .decay_steps = 10};
  CHECK(runtime::lr_at(c, lr, 0) == Approx(lr));
  CHECK(runtime::lr_at(c, lr, 10) == 0.0f);
}

TEST_CASE("a schedule that cannot be is refused by its field") {
  CHECK_THROWS_WITH((runtime::lr_schedule{.decay = runtime::lr_decay::cosine, .warmup_steps = 10, .decay_steps = 10}.check()),
                    ContainsSubstring("cosine decay ends at step 10") && ContainsSubstring("decay_steps"));
  CHECK_THROWS_WITH((runtime::lr_schedule{.min_ratio = 1.5f}.check()), ContainsSubstring("min_ratio"));
  CHECK_THROWS_WITH((runtime::lr_schedule{.warmup_steps = -1}.check()), ContainsSubstring("warmup_steps -1"));
  CHECK(runtime::parse_lr_decay("linear") == runtime::lr_decay::linear);
  CHECK_THROWS_WITH(runtime::parse_lr_decay("step"), ContainsSubstring("not one of constant, linear, cosine"));
}
