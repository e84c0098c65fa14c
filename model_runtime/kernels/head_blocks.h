// A row's query heads 0..G-1 in blocks of at most HB (1..4) whose size is a compile-time constant: run(nh, g) for
// the nh heads from g (std::integral_constant nh). Attention's sums of p v take a row's heads together this way in
// portable.cpp's pv_heads, so that each block's sums stay in registers.
#pragma once
#include <cstdint>
#include <type_traits>

template <int64_t HB, class Run>
inline void head_blocks(int64_t G, Run run) {
  static_assert(HB >= 1 && HB <= 4, "blocks of 1 to 4 heads");
  for (int64_t g = 0; g < G;) {
    const int64_t left = G - g;
    if (left >= HB) { run(std::integral_constant<int64_t, HB>{}, g); g += HB; }
    else if (left == 3) { run(std::integral_constant<int64_t, 3>{}, g); g += 3; }
    else if (left == 2) { run(std::integral_constant<int64_t, 2>{}, g); g += 2; }
    else { run(std::integral_constant<int64_t, 1>{}, g); g += 1; }
  }
}
