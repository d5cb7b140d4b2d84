// Unit tests of the host planner (../lora_tiling.cpp), independent of the kernel and of the emulation:
//
//   * every group-size pattern (uneven with empty experts, all empty, one dominant expert, tails that
//     are not multiples of the tile, one expert, many experts) x ranks 0, 4, 8, 16, 32 x small and
//     production sizes x Atlas A2 and tiny hardware budgets, forward and every backward output mask;
//   * structure: each problem's output covered by exactly one tile per block, zero tiles exactly for
//     the per-expert outputs (dA, dB) of experts without rows, core ranges partitioning the tile list,
//     row offsets = prefix sums, header offsets and sizes;
//   * budgets: tiles within the per-buffer budgets, TPipe totals within L1/L0A/L0B/L0C/UB, Mmad and
//     DMA parameter ranges;
//   * balance: longest-processing-time-first keeps every core within (total / cores + largest tile)
//     and spreads a dominant expert's tiles;
//   * meaning: a plain fp64 interpreter of the tiling descriptors reproduces h, y, dh, dB, dx, dA from
//     their definitions (catches a wrong leading dimension, layout or operand).
//
//   tiling_test        exit 0 when all checks pass, 1 otherwise
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "../lora_tiling.h"
#include "../packed_tiling.h"

namespace {

using namespace slmoe_ascend;

int g_checks = 0, g_failures = 0;
std::string g_context;

#define CHECK(cond, ...)                                                          \
  do {                                                                            \
    ++g_checks;                                                                   \
    if (!(cond)) {                                                                \
      ++g_failures;                                                               \
      std::printf("FAIL %s: %s: ", g_context.c_str(), #cond);                     \
      std::printf(__VA_ARGS__);                                                   \
      std::printf("\n");                                                          \
    }                                                                             \
  } while (0)

HwCaps a2() { return HwCaps{}; }
HwCaps tiny() {
  HwCaps c;
  c.numAic = 3;
  c.l1Bytes = 12 * 1024;
  c.l0aBytes = 2 * 1024;
  c.l0bBytes = 2 * 1024;
  c.l0cBytes = 8 * 1024;
  c.ubBytes = 4 * 1024;
  return c;
}


void check_plan(const LaunchPlan& plan, const LoraDims& d, const std::vector<int64_t>& counts, const HwCaps& caps) {
  (void)d;
  const int64_t E = d.E;
  const KernelTiling& h = tiling_header(plan);
  CHECK(h.magic == kTilingMagic && h.version == kTilingVersion, "header magic/version");
  CHECK(h.numExperts == static_cast<uint32_t>(E), "numExperts %u", h.numExperts);
  CHECK(h.coreTileBeginOffset % 8 == 0 && h.tilesOffset % 8 == 0 && h.rowOffsetOffset % 8 == 0, "8-byte aligned parts");
  CHECK(plan.tiling.size() == h.rowOffsetOffset + (E + 1) * sizeof(uint64_t), "buffer size %zu", plan.tiling.size());
  CHECK(plan.blockDim == h.numCores, "blockDim %u vs numCores %u", plan.blockDim, h.numCores);
  CHECK(h.numCores == std::min<uint32_t>(caps.numAic, h.numTiles), "cores %u for %u tiles", h.numCores, h.numTiles);

  const uint64_t* ro = tiling_row_offsets(plan);
  CHECK(ro[0] == 0, "rowOffset[0]");
  for (int64_t e = 0; e < E; ++e) CHECK(ro[e + 1] - ro[e] == static_cast<uint64_t>(counts[e]), "rowOffset of %lld", (long long)e);

  // Budgets and parameter ranges.
  const Budgets b = budgets_for(caps);
  for (uint32_t pi = 0; pi < h.numProblems; ++pi) {
    const ProblemDesc& p = h.problems[pi];
    CHECK(p.baseM % 16 == 0 && p.baseN % 16 == 0 && p.baseK % 16 == 0 && p.baseM > 0 && p.baseN > 0 && p.baseK > 0,
          "tile %ux%ux%u", p.baseM, p.baseN, p.baseK);
    CHECK(p.kL1 % p.baseK == 0 && p.kL1 >= p.baseK, "kL1 %u baseK %u", p.kL1, p.baseK);
    CHECK(p.baseM * p.kL1 * 2 <= b.a1 && p.kL1 * p.baseN * 2 <= b.b1, "L1 staging %u/%u", p.baseM * p.kL1 * 2, p.kL1 * p.baseN * 2);
    CHECK(p.baseM * p.baseK * 2 <= b.a2 && p.baseK * p.baseN * 2 <= b.b2, "L0A/L0B tile");
    CHECK(p.baseM * p.baseN * 4 <= b.c1, "L0C tile %u", p.baseM * p.baseN * 4);
    CHECK(p.baseM <= 4095 && p.baseN <= 4095 && p.baseK <= 4095, "Mmad m, n, k <= 4095");
    CHECK(p.baseN / 16 <= 255 && p.baseK / 16 <= 255, "LoadData repeatTimes <= 255");
    CHECK(p.epiRows >= 1 && p.epiRows <= (p.baseM + 1) / 2, "epiRows %u for baseM %u", p.epiRows, p.baseM);
    CHECK(p.numTerms * p.baseM * p.baseN <= h.wsSlotFloats, "workspace slot");
    CHECK(p.epiRows * p.baseN * 4 * p.numTerms <= h.accBytes && p.epiRows * p.baseN * 2 <= h.outBytes, "UB chunk");
  }
  CHECK(2ull * h.a1Bytes + 2ull * h.b1Bytes <= caps.l1Bytes, "L1 %u", 2 * h.a1Bytes + 2 * h.b1Bytes);
  CHECK(2ull * h.a2Bytes <= caps.l0aBytes && 2ull * h.b2Bytes <= caps.l0bBytes, "L0A/L0B totals");
  CHECK(2ull * h.c1Bytes <= caps.l0cBytes, "L0C total %u", 2 * h.c1Bytes);
  CHECK(2ull * h.accBytes + 2ull * h.maskBytes + h.maskF32Bytes + 2ull * h.outBytes <= caps.ubBytes, "UB total");
  CHECK(plan.workspaceBytes == 4ull * kWorkspaceSlots * h.numCores * h.wsSlotFloats, "workspace bytes");

  // Core ranges partition the tile list; every core has work.
  const uint32_t* cb = tiling_core_begin(plan);
  CHECK(h.numCores == 0 || (cb[0] == 0 && cb[h.numCores] == h.numTiles), "core ranges span the tiles");
  for (uint32_t c = 0; c < h.numCores; ++c) CHECK(cb[c] < cb[c + 1], "core %u has tiles", c);

  // Coverage: each (expert, row block, column block) of each problem exactly once; zero tiles only
  // for the per-expert (non-grouped M) problems.
  const TileRec* tiles = tiling_tiles(plan);
  for (uint32_t pi = 0; pi < h.numProblems; ++pi) {
    const ProblemDesc& p = h.problems[pi];
    for (int64_t e = 0; e < E; ++e) {
      const uint32_t rows = problem_rows(p, counts.data(), static_cast<uint32_t>(e));
      const uint32_t mb = rows == 0 || p.n == 0 ? 0 : (rows + p.baseM - 1) / p.baseM;
      const uint32_t nb = p.n == 0 ? 0 : (p.n + p.baseN - 1) / p.baseN;
      std::vector<int> seen(static_cast<size_t>(mb) * nb, 0);
      for (uint32_t i = 0; i < h.numTiles; ++i) {
        const TileRec& t = tiles[i];
        if (t.problem != pi || t.expert != static_cast<uint32_t>(e)) continue;
        CHECK(t.mBlock < mb && t.nBlock < nb, "tile block in range");
        if (t.mBlock < mb && t.nBlock < nb) ++seen[t.mBlock * nb + t.nBlock];
        bool any_k = false;
        for (uint32_t k = 0; k < p.numTerms; ++k) any_k = any_k || term_k(p.terms[k], counts.data(), e) > 0;
        if (!any_k) CHECK(!p.mGrouped, "zero tile only where the output is per expert");
      }
      for (int s : seen) CHECK(s == 1, "problem %u expert %lld: block covered %d times", pi, (long long)e, s);
    }
  }

  // Balance: list scheduling bound, and costs add up.
  double total = 0, largest = 0;
  for (uint32_t i = 0; i < h.numTiles; ++i) {
    const double c = tile_cost(h.problems[tiles[i].problem], tiles[i], counts.data());
    total += c;
    largest = std::max(largest, c);
  }
  double sum = 0, worst = 0;
  for (double c : plan.coreCost) {
    sum += c;
    worst = std::max(worst, c);
  }
  CHECK(std::fabs(sum - total) <= 1e-6 * std::max(1.0, total), "core costs add up");
  if (h.numCores > 0) {
    CHECK(worst <= total / h.numCores + largest + 1e-6, "makespan %.0f > total/cores %.0f + largest %.0f", worst,
          total / h.numCores, largest);
  }
}

// ----- fp64 interpreter of the descriptors -----------------------------------------------------

struct Tensors {
  std::vector<double> t[kNumTensors];
};

double operand(const Tensors& ts, const OperandDesc& d, uint32_t e, uint64_t row_off, uint64_t i, uint64_t j) {
  const uint64_t base = OperandOrigin(d, e, row_off);
  return ts.t[d.tensor][base + i * d.ld + j];
}

// Element (m, n) of expert e's A * B for one term, read through the descriptors.
double term_value(const Tensors& ts, const TermDesc& d, uint32_t e, uint64_t row_off, uint32_t K, uint32_t m,
                  uint32_t n) {
  double acc = 0;
  for (uint32_t k = 0; k < K; ++k) {
    const double a = d.a.layout == kLayoutRowMajor ? operand(ts, d.a, e, row_off, m, k) : operand(ts, d.a, e, row_off, k, m);
    const double b = d.b.layout == kLayoutRowMajor ? operand(ts, d.b, e, row_off, n, k) : operand(ts, d.b, e, row_off, k, n);
    acc += a * b;
  }
  double f = d.scale;
  if (d.mask.tensor != kNoTensor) f *= operand(ts, d.mask, e, row_off, m, n);
  return f * acc;
}

void interpret(const LaunchPlan& plan, const std::vector<int64_t>& counts, Tensors& ts) {
  const KernelTiling& h = tiling_header(plan);
  const TileRec* tiles = tiling_tiles(plan);
  const uint64_t* ro = tiling_row_offsets(plan);
  for (uint32_t i = 0; i < h.numTiles; ++i) {
    const ProblemDesc& p = h.problems[tiles[i].problem];
    const uint32_t e = tiles[i].expert;
    const uint64_t rows_e = static_cast<uint64_t>(counts[e]);
    const TileExtent x = TileExtentOf(p, tiles[i], ProblemRows(p, rows_e));
    for (uint32_t m = x.m0; m < x.m0 + x.mLen; ++m) {
      for (uint32_t n = x.n0; n < x.n0 + x.nLen; ++n) {
        double v = 0;
        for (uint32_t t = 0; t < p.numTerms; ++t) v += term_value(ts, p.terms[t], e, ro[e], TermK(p.terms[t], rows_e), m, n);
        const uint64_t at = OperandOrigin(p.c, e, ro[e]) + static_cast<uint64_t>(m) * p.c.ld + n;
        ts.t[p.c.tensor][at] = v;
      }
    }
  }
}

double max_rel(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(got[i] - want[i]));
    ref = std::max(ref, std::fabs(want[i]));
  }
  return ref > 0 ? diff / ref : diff;
}

void check_meaning(const LoraDims& d, const std::vector<int64_t>& counts, const HwCaps& caps, bool mask, std::mt19937_64& rng) {
  const int64_t T = d.T, E = d.E, din = d.d_in, dout = d.d_out, r = d.r;
  const double s = d.scaling;
  std::normal_distribution<double> normal;
  Tensors ts;
  auto sized = [&](TensorId id, int64_t n, bool random) {
    ts.t[id].assign(static_cast<size_t>(n), std::nan(""));
    if (random) for (auto& v : ts.t[id]) v = normal(rng);
  };
  sized(kTensorX, T * din, true);
  sized(kTensorWeight, E * dout * din, true);
  sized(kTensorLoraA, E * r * din, true);
  sized(kTensorLoraB, E * dout * r, true);
  sized(kTensorGradY, T * dout, true);
  sized(kTensorMask, T * din, true);
  sized(kTensorLoraX, T * din, true);
  sized(kTensorH, T * r, false);
  sized(kTensorY, T * dout, false);
  sized(kTensorDh, T * r, false);
  sized(kTensorDx, T * din, false);
  sized(kTensorDa, E * r * din, false);
  sized(kTensorDb, E * dout * r, false);
  for (const auto& plan : plan_forward(d, counts.data(), caps)) interpret(plan, counts, ts);
  for (const auto& plan : plan_backward(d, counts.data(), mask, true, true, true, caps)) interpret(plan, counts, ts);

  // Definitions (lora_x is its own tensor here: the plans must read it, not x, for h and dA).
  std::vector<double> H(T * r), Y(T * dout), DH(T * r), DX(T * din), DA(E * r * din, 0.0), DB(E * dout * r, 0.0);
  const auto& X = ts.t[kTensorX];
  const auto& LX = ts.t[kTensorLoraX];
  const auto& W = ts.t[kTensorWeight];
  const auto& A = ts.t[kTensorLoraA];
  const auto& B = ts.t[kTensorLoraB];
  const auto& GY = ts.t[kTensorGradY];
  const auto& M = ts.t[kTensorMask];
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = row; i < row + counts[e]; ++i) {
      for (int64_t j = 0; j < r; ++j) {
        double a = 0, g = 0;
        for (int64_t k = 0; k < din; ++k) a += LX[i * din + k] * A[(e * r + j) * din + k];
        for (int64_t o = 0; o < dout; ++o) g += s * GY[i * dout + o] * B[(e * dout + o) * r + j];
        H[i * r + j] = a;
        DH[i * r + j] = g;
      }
      for (int64_t o = 0; o < dout; ++o) {
        double base = 0, lora = 0;
        for (int64_t k = 0; k < din; ++k) base += X[i * din + k] * W[(e * dout + o) * din + k];
        for (int64_t j = 0; j < r; ++j) lora += ts.t[kTensorH][i * r + j] * B[(e * dout + o) * r + j];
        Y[i * dout + o] = base + s * lora;
      }
      for (int64_t k = 0; k < din; ++k) {
        double base = 0, lora = 0;
        for (int64_t o = 0; o < dout; ++o) base += GY[i * dout + o] * W[(e * dout + o) * din + k];
        for (int64_t j = 0; j < r; ++j) lora += ts.t[kTensorDh][i * r + j] * A[(e * r + j) * din + k];
        DX[i * din + k] = base + (mask ? M[i * din + k] : 1.0) * lora;
      }
      for (int64_t j = 0; j < r; ++j)
        for (int64_t k = 0; k < din; ++k) DA[(e * r + j) * din + k] += ts.t[kTensorDh][i * r + j] * LX[i * din + k];
      for (int64_t o = 0; o < dout; ++o)
        for (int64_t j = 0; j < r; ++j) DB[(e * dout + o) * r + j] += s * GY[i * dout + o] * ts.t[kTensorH][i * r + j];
    }
    row += counts[e];
  }
  CHECK(max_rel(ts.t[kTensorH], H) < 1e-12, "h");
  CHECK(max_rel(ts.t[kTensorY], Y) < 1e-12, "y");
  CHECK(max_rel(ts.t[kTensorDh], DH) < 1e-12, "dh");
  CHECK(max_rel(ts.t[kTensorDx], DX) < 1e-12, "dx");
  CHECK(max_rel(ts.t[kTensorDa], DA) < 1e-12, "dA");
  CHECK(max_rel(ts.t[kTensorDb], DB) < 1e-12, "dB");
}

struct Pattern {
  const char* name;
  std::vector<int64_t> counts;
};

}  // namespace

int main() {
  std::mt19937_64 rng(7);
  std::vector<int64_t> many(128);
  std::uniform_int_distribution<int> pick(0, 40);
  for (auto& n : many) n = pick(rng);
  const std::vector<Pattern> patterns = {
      {"uneven_with_empty", {0, 5, 0, 7, 3, 0}},
      {"all_empty", {0, 0, 0, 0}},
      {"one_dominant", {1, 5000, 0, 3}},
      {"tails", {129, 255, 1, 17, 16, 15}},
      {"single_expert", {300}},
      {"many_experts", many},
  };
  struct Sizes {
    int64_t d_in, d_out;
  };
  int plans = 0;
  for (const Pattern& pat : patterns) {
    int64_t T = 0;
    for (int64_t c : pat.counts) T += c;
    for (int64_t r : {0, 4, 8, 16, 32}) {
      for (Sizes sz : {Sizes{13, 37}, Sizes{2048, 1536}}) {
        for (int caps_kind = 0; caps_kind < 2; ++caps_kind) {
          const HwCaps caps = caps_kind == 0 ? a2() : tiny();
          LoraDims d;
          d.T = T;
          d.E = static_cast<int64_t>(pat.counts.size());
          d.d_in = sz.d_in;
          d.d_out = sz.d_out;
          d.r = r;
          d.scaling = 2.0;
          g_context = std::string(pat.name) + " r=" + std::to_string(r) + " " + std::to_string(sz.d_in) + "x" +
                      std::to_string(sz.d_out) + (caps_kind ? " tiny" : " a2");
          for (const auto& p : plan_forward(d, pat.counts.data(), caps)) {
            check_plan(p, d, pat.counts, caps);
            ++plans;
          }
          for (int mask = 0; mask < 2; ++mask) {
            for (int outs = 1; outs < 8; ++outs) {
              for (const auto& p :
                   plan_backward(d, pat.counts.data(), mask, outs & 1, outs & 2, outs & 4, caps)) {
                check_plan(p, d, pat.counts, caps);
                ++plans;
              }
            }
          }
          // Meaning, on the small sizes (the interpreter is a plain triple loop).
          if (sz.d_in < 100 && T <= 2000) {
            for (int mask = 0; mask < 2; ++mask) check_meaning(d, pat.counts, caps, mask, rng);
          }
        }
      }
    }
  }

  // A dominant expert's reduction tiles (dA, dB) must not pile up on a few cores: the LPT plan's
  // slowest core stays within 10% of the lower bound max(total / cores, largest tile).
  {
    g_context = "dominant expert balance";
    const std::vector<int64_t> counts = {1, 5000, 0, 3, 2, 0, 7, 1};
    LoraDims d;
    d.E = static_cast<int64_t>(counts.size());
    for (int64_t c : counts) d.T += c;
    d.d_in = 2048;
    d.d_out = 1536;
    d.r = 16;
    for (const auto& plan : plan_backward(d, counts.data(), false, true, true, true, a2())) {
      const KernelTiling& h = tiling_header(plan);
      double total = 0, largest = 0, worst = 0;
      for (uint32_t i = 0; i < h.numTiles; ++i) {
        const double c = tile_cost(h.problems[tiling_tiles(plan)[i].problem], tiling_tiles(plan)[i], counts.data());
        total += c;
        largest = std::max(largest, c);
      }
      for (double c : plan.coreCost) worst = std::max(worst, c);
      const double bound = std::max(total / h.numCores, largest);
      CHECK(worst <= 1.10 * bound, "%s: slowest core %.0f vs lower bound %.0f", plan.name.c_str(), worst, bound);
      std::printf("balance %-9s %u tiles on %u cores: slowest core %.0f, lower bound %.0f (%.3fx)\n", plan.name.c_str(),
                  h.numTiles, h.numCores, worst, bound, worst / bound);
    }
  }

  // Budgets too small for one 16x16x16 tile are refused in one line, not planned past the hardware.
  {
    g_context = "impossible budgets";
    HwCaps caps = tiny();
    caps.l0aBytes = 512;
    LoraDims d;
    d.T = 4;
    d.E = 1;
    d.d_in = 16;
    d.d_out = 16;
    d.r = 4;
    const std::vector<int64_t> counts = {4};
    bool refused = false;
    try {
      plan_forward(d, counts.data(), caps);
    } catch (const std::invalid_argument& e) {
      refused = std::string(e.what()).find("too small") != std::string::npos;
    }
    CHECK(refused, "plan_forward refuses L0A of 512 bytes");
  }

  // The packed path's planner (../packed_tiling.cpp) at production shapes: the decode of every format
  // fits the unified buffer at kPackedMaxWidth, its segments tile each row exactly (on scale-block
  // edges when a row takes several), and the chunk loop covers every expert and row once.
  {
    struct Fmt {
      const char* name;
      PackedWeightDesc w;
    };
    auto desc = [](PackedFormat f, ScaleType s, uint32_t br, uint32_t bc) {
      PackedWeightDesc w;
      w.format = f, w.scaleType = s, w.blockRows = br, w.blockCols = bc;
      return w;
    };
    const Fmt fmts[] = {{"mxfp4", desc(kPackedMxfp4, kScaleF32, 1, 32)},
                        {"int4_g32_bf16", desc(kPackedInt4, kScaleBf16, 1, 32)},
                        {"int4_g128_f32", desc(kPackedInt4, kScaleF32, 1, 128)},
                        {"fp8_128x128", desc(kPackedBlockFp8, kScaleF32, 128, 128)},
                        {"fp8_16x100", desc(kPackedBlockFp8, kScaleF32, 16, 100)}};
    const HwCaps caps = a2();
    for (const Fmt& f : fmts) {
      for (Sizes sz : {Sizes{7168, 2048}, Sizes{3072, 3584}, Sizes{3584, 3072}, Sizes{256, 40}}) {
        g_context = std::string("packed ") + f.name + " " + std::to_string(sz.d_in) + "x" + std::to_string(sz.d_out);
        DecodePlan plan;
        const std::vector<int64_t> counts = {3, 0, 5};
        const std::string err = plan_decode(f.w, sz.d_out, sz.d_in, 0, 3, counts.data(), caps, kPackedMaxWidth, &plan);
        CHECK(err.empty(), "refused: %s", err.c_str());
        if (!err.empty()) continue;
        PackedDecodeTiling h;
        std::memcpy(&h, plan.tiling.data(), sizeof h);
        const PackedCalcLayout calc = PackedCalcLayoutOf(h.width, h.planeWords, h.scaleSpan);
        const uint64_t ub = calc.total + 2ull * (h.ubPackedBytes + h.ubScaleBytes + Align32Bytes(h.width * 2));
        CHECK(ub <= caps.ubBytes, "UB %llu", static_cast<unsigned long long>(ub));
        CHECK(h.width <= kPackedMaxWidth && static_cast<uint64_t>(h.segmentsPerRow) * h.width >= h.dIn &&
                  static_cast<uint64_t>(h.segmentsPerRow - 1) * h.width < h.dIn,
              "segments of %u columns x %u", h.width, h.segmentsPerRow);
        CHECK(h.segmentsPerRow == 1 || h.width % h.blockCols == 0, "segments start on scale blocks");
        CHECK(h.scaleSpan * h.blockCols >= h.width, "scale span %u", h.scaleSpan);
        const uint32_t* decode = reinterpret_cast<const uint32_t*>(plan.tiling.data() + h.decodeOffset);
        CHECK(decode[0] == 1 && decode[1] == 0 && decode[2] == 1, "experts with rows decoded, the empty one not");
        CHECK(plan.blockDim == std::min<uint64_t>(2ull * caps.numAic, 2ull * sz.d_out * h.segmentsPerRow),
              "vector units %u", plan.blockDim);
      }
    }
    g_context = "packed refusals";
    DecodePlan plan;
    CHECK(!plan_decode(desc(kPackedInt4, kScaleBf16, 1, 48), 8, 96, 0, 1, nullptr, caps, kPackedMaxWidth, &plan).empty(),
          "INT4 group 48 refused");
    CHECK(!plan_decode(desc(kPackedMxfp4, kScaleF32, 1, 32), 8, 80, 0, 1, nullptr, caps, kPackedMaxWidth, &plan).empty(),
          "MXFP4 width 80 refused");
    CHECK(!plan_decode(desc(kPackedBlockFp8, kScaleF32, 128, 2000), 8, 7168, 0, 1, nullptr, caps, kPackedMaxWidth, &plan)
               .empty(),
          "FP8 blocks of 2000 columns on 7168-wide rows refused");

    g_context = "packed chunks";
    const std::vector<int64_t> counts = {0, 5, 0, 0, 7, 3, 0};
    LoraDims d;
    d.E = static_cast<int64_t>(counts.size());
    d.T = 15, d.d_in = 64, d.d_out = 40, d.r = 8;
    for (int64_t chunk : {1, 2, 3, 7}) {
      std::vector<PackedStep> fwd, bwd, bwd_no_dx;
      const PackedWeightDesc w = fmts[0].w;
      CHECK(plan_packed_forward(d, counts.data(), w, chunk, caps, kPackedMaxWidth, &fwd).empty(), "forward plan");
      CHECK(plan_packed_backward(d, counts.data(), w, chunk, false, true, true, true, caps, kPackedMaxWidth, &bwd).empty(),
            "backward plan");
      CHECK(plan_packed_backward(d, counts.data(), w, chunk, false, false, true, true, caps, kPackedMaxWidth, &bwd_no_dx)
                .empty(),
            "backward plan without dx");
      CHECK(static_cast<int64_t>(bwd.size()) == (d.E + chunk - 1) / chunk, "backward: every chunk (zero dA/dB)");
      int64_t rows = 0, next = 0;
      for (const PackedStep& s : bwd) {
        CHECK(s.e0 == next && s.row0 == rows, "chunk at expert %lld row %lld", (long long)s.e0, (long long)s.row0);
        CHECK((s.decode.blockDim > 0) == (s.rows > 0), "backward decodes exactly the chunks with rows");
        next = s.e0 + s.experts;
        rows += s.rows;
      }
      CHECK(next == d.E && rows == d.T, "chunks cover %lld experts, %lld rows", (long long)next, (long long)rows);
      for (const PackedStep& s : fwd) CHECK(s.rows > 0 && s.decode.blockDim > 0, "forward: chunks with rows only");
      for (const PackedStep& s : bwd_no_dx) CHECK(s.decode.blockDim == 0, "no dx: no decode");
    }
  }

  std::printf("tiling_test: %d checks over %d plans, %d failed\n", g_checks, plans, g_failures);
  return g_failures ? 1 : 0;
}
