// The chunked KDA algorithm on one chunk (at most kChunk steps) of one value head, written once
// for both backends: the CPU kernel runs it with a one-member team, the CUDA kernels with a team
// of the threads of a block. Arrays are row-major with the leading dimensions given below; they
// may live anywhere the team can read (host memory, shared or global memory).
//
// Per chunk with start state S0 [K,V], normalised q, k [L,K], v [L,V], beta [L] and G [L,K] the
// cumulative log-decay inside the chunk (G_t = g_0 + ... + g_t), the recurrence of
// reference/kda.py unrolls to (E_ts = exp(G_t - G_s) <= 1 for s <= t, never exp of a positive
// number, so strongly decaying gates cannot overflow):
//   A_ts   = sum_c k_t k_s E_ts   (s < t)        Aqk_ts = sum_c q_t k_s E_ts   (s <= t)
//   Minv = (I + diag(beta) A)^-1,  [W | Ut] = Minv diag(beta) [k exp(G) | v]
//   Qg = q exp(G),  Kd = k exp(G_last - G),  gC = exp(G_last)
//   U = Ut - W S0,  O = scale (Qg S0 + Aqk U),  S1 = diag(gC) S0 + Kd^T U.
// Off the kSub x kSub diagonal blocks, E_ts factors through the first row r of t's block:
// E_ts = exp(G_t - G_r) exp(G_r - G_s), both <= 1 because s < r <= t, which turns those blocks
// of A and Aqk into products of matrices; only the diagonal blocks take an exp per (t, s, c).
// Everything of the shape of a matrix product runs through team_gemm. The backward
// differentiates exactly these steps (chunk_bwd below).
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define KDA_HD __host__ __device__ __forceinline__
#else
#define KDA_HD inline
#endif

namespace kda_dsa_ops::kda {

constexpr int kChunk = 64;  // steps per chunk; A, Aqk and their gradients have leading dimension kChunk

KDA_HD float exp_of(float x) { return expf(x); }
KDA_HD double exp_of(double x) { return exp(x); }
template <typename T>
KDA_HD bool finite(T x) {
#if defined(__CUDA_ARCH__)
  return ::isfinite(x);
#else
  return std::isfinite(x);
#endif
}

// Log-decays below this count as it: exp(-128) (2.6e-56) is zero in fp32, a reset of the state as
// g = -inf is, and cumulative sums stay finite (the bf16 kernels' plain fp32 sum keeps its
// accuracy). NaN stays NaN.
constexpr float kMinLogDecay = -128.f;
template <typename T>
KDA_HD T floor_log_decay(T x) {
  return x < T(kMinLogDecay) ? T(kMinLogDecay) : x;
}

// Sizes of one chunk's working set.
struct ChunkDims {
  int L;  // steps in this chunk (1..kChunk)
  int K;  // key width
  int V;  // value width (or the width of the value tile a state step works on)
};

// The cumulative log-decay G = hi + lo of a chunk, [L,K] each. The sum is carried exactly
// (two-sum), so that G_t - G_s is accurate to its own size: a plain fp32 running sum would put
// an error of |G| * 6e-8 (|G| reaches 1e4) into every exp(G_t - G_s).
template <typename T>
struct Gates {
  const T* hi;
  const T* lo;
  KDA_HD T diff(int a, int b) const { return (hi[a] - hi[b]) + (lo[a] - lo[b]); }
  KDA_HD T exp_diff(int a, int b) const { return exp_of(diff(a, b)); }
  KDA_HD T exp_at(int a) const { return exp_of(hi[a]) * exp_of(lo[a]); }
};

// G.hi in place over g ([L,K]), G.lo into lo.
template <typename T, typename Team>
KDA_HD void chunk_cumsum(const Team& tm, ChunkDims d, T* G, T* lo) {
  for (int c = tm.rank(); c < d.K; c += tm.size()) {
    T hi = 0, err = 0;
    for (int t = 0; t < d.L; ++t) {
      const T x = floor_log_decay(G[t * d.K + c]), s = hi + x, xb = s - hi;
      err += (hi - (s - xb)) + (x - xb);
      hi = s;
      G[t * d.K + c] = hi;
      lo[t * d.K + c] = err;
    }
  }
  tm.sync();
}

// The forward's rule for non-finite inputs (chunk_kda's docstring): a NaN or inf in k, g (NaN or
// +inf) or beta at step t makes every output from step t on and the end state NaN; one in v[t, j]
// those of value column j. The chunk algebra multiplies the zeros above the diagonals of Aqk and
// Minv with later rows, which would carry such a value to earlier steps, so the forward computes
// on finite stand-ins: chunk_mark_nonfinite (before chunk_cumsum, on the raw g) finds the first
// such step of k, g, beta and of each column of v in one pass (the members' atomic_min), and only
// where there is one zeroes k, g, beta and v from it on (v[., j] from its column's); it writes
// mark[j] = the first step whose output in column j is NaN and mark[V] = the first of all (L where
// none: the chunk is clean); apply_marks then writes the NaNs. q needs no stand-in: its rows only
// reach their own step's output. first [V + 2] is int scratch.
template <typename T, typename Team>
KDA_HD void chunk_mark_nonfinite(const Team& tm, ChunkDims d, T* k, T* g, T* v, T* beta, int* first,
                                 unsigned char* mark) {
  const int L = d.L, K = d.K, V = d.V;  // first[V]: k, g, beta's first step; first[V + 1]: any
  for (int j = tm.rank(); j < V + 2; j += tm.size()) first[j] = L;
  tm.sync();
  for (int i = tm.rank(); i < L * K; i += tm.size()) {
    if (!finite(k[i]) || !(g[i] < T(INFINITY))) tm.atomic_min(first + V, i / K);
  }
  for (int t = tm.rank(); t < L; t += tm.size()) {
    if (!finite(beta[t])) tm.atomic_min(first + V, t);
  }
  for (int i = tm.rank(); i < L * V; i += tm.size()) {
    if (!finite(v[i])) tm.atomic_min(first + i % V, i / V);
  }
  tm.sync();
  const int row = first[V];
  for (int j = tm.rank(); j < V; j += tm.size()) {
    const int m = first[j] < row ? first[j] : row;
    mark[j] = static_cast<unsigned char>(m);
    if (m < L) tm.atomic_min(first + V + 1, m);
  }
  tm.sync();
  const int any = first[V + 1];
  if (tm.rank() == 0) mark[V] = static_cast<unsigned char>(any);
  if (any == L) return;  // (no member writes below: the tiles stay as loaded)
  for (int i = tm.rank(); i < L * V; i += tm.size()) {
    const int t = i / V, j = i % V;
    if (t >= (first[j] < row ? first[j] : row)) v[i] = 0;
  }
  for (int i = row * K + tm.rank(); i < L * K; i += tm.size()) k[i] = g[i] = 0;
  for (int t = row + tm.rank(); t < L; t += tm.size()) beta[t] = 0;
  tm.sync();
}

// NaN into the outputs O [L, Vt] (leading dim ldO; skipped for nullptr) from step mark[j] on and
// into the state columns S [K, Vt] (leading dim ldS) whose mark is below L (marks of the tile's
// columns; only for a chunk that is not clean).
template <typename T, typename Team>
KDA_HD void apply_marks(const Team& tm, ChunkDims d, const unsigned char* mark, T* O, int ldO, T* S, int ldS) {
  for (int i = tm.rank(); O != nullptr && i < d.L * d.V; i += tm.size()) {
    if (i / d.V >= mark[i % d.V]) O[(i / d.V) * ldO + i % d.V] = T(NAN);
  }
  for (int i = tm.rank(); i < d.K * d.V; i += tm.size()) {
    if (mark[i % d.V] < d.L) S[(i / d.V) * ldS + i % d.V] = T(NAN);
  }
  tm.sync();
}

// Strided matrix views: element (r, c) at p[r * rs + c * cs].
template <typename T>
struct View {
  const T* p;
  int rs, cs;
  KDA_HD T operator()(int r, int c) const { return p[r * rs + c * cs]; }
};
template <typename T>
struct Out {
  T* p;
  int rs, cs;
  KDA_HD T& operator()(int r, int c) const { return p[r * rs + c * cs]; }
};
// A row-major [*, ld] matrix, and its transpose.
template <typename T>
KDA_HD View<T> rows_of(const T* p, int ld) {
  return {p, ld, 1};
}
template <typename T>
KDA_HD View<T> cols_of(const T* p, int ld) {
  return {p, 1, ld};
}
template <typename T>
KDA_HD Out<T> out_rows(T* p, int ld) {
  return {p, ld, 1};
}

// The term team_gemm adds to the product: (row ? row[m] : beta) * (src ? src(m, n) : C(m, n)).
template <typename T>
struct Prior {
  T beta = 0;
  const T* row = nullptr;
  const T* src = nullptr;
  int src_ld = 0;
  // c = value + the term.
  KDA_HD void store(T& c, T value, int m, int n) const {
    if (beta != T(0) || row != nullptr) {
      value += (row != nullptr ? row[m] : beta) * (src != nullptr ? src[m * src_ld + n] : c);
    }
    c = value;
  }
};
template <typename T>
KDA_HD Prior<T> plus_c() {
  return Prior<T>{T(1), nullptr, nullptr, 0};
}

// C(m, n) = alpha * sum_k A(m, k) kscale[k] B(k, n) + prior, for m < M, n < N. Each member
// computes 4 x 4 elements of C, rows and columns interleaved so that the members of a warp read
// one row of A (broadcast) and consecutive columns of B. Two calls with equal M and N give every
// member the same elements, so the second may accumulate into the first's C without a sync.
template <typename T, typename Team>
KDA_HD void team_gemm(const Team& tm, int M, int N, int Kn, T alpha, View<T> A, View<T> B, Out<T> C,
                      Prior<T> prior = Prior<T>{}, const T* kscale = nullptr) {
  constexpr int R = 4;
  const int mb = (M + R - 1) / R, nb = (N + R - 1) / R;
  for (int tile = tm.rank(); tile < mb * nb; tile += tm.size()) {
    const int m0 = tile / nb, n0 = tile % nb;
    int mi[R], ni[R];
    for (int i = 0; i < R; ++i) {
      mi[i] = m0 + i * mb < M ? m0 + i * mb : M - 1;
      ni[i] = n0 + i * nb < N ? n0 + i * nb : N - 1;
    }
    T acc[R][R];
    for (int i = 0; i < R; ++i) {
      for (int j = 0; j < R; ++j) acc[i][j] = 0;
    }
    for (int k = 0; k < Kn; ++k) {
      const T ks = kscale != nullptr ? kscale[k] : T(1);
      T a[R], b[R];
      for (int i = 0; i < R; ++i) a[i] = A(mi[i], k) * ks;
      for (int j = 0; j < R; ++j) b[j] = B(k, ni[j]);
      for (int i = 0; i < R; ++i) {
        for (int j = 0; j < R; ++j) acc[i][j] += a[i] * b[j];
      }
    }
    for (int i = 0; i < R; ++i) {
      const int m = m0 + i * mb;
      if (m >= M) break;
      for (int j = 0; j < R; ++j) {
        const int n = n0 + j * nb;
        if (n >= N) break;
        prior.store(C(m, n), alpha * acc[i][j], m, n);
      }
    }
  }
}

// The CPU kernel's team: one member, nothing to wait for, products by team_gemm. A team (also
// the CUDA kernels' block team) provides rank(), size(), sync(), atomic_min(int*, int) on memory
// the team shares, gemm(...) with the arguments
// of team_gemm after the team, gemm_fp32(...), the same at fp32 accuracy whatever the team's
// product precision, and pair_exp(x), the exp of the diagonal blocks' pair terms (the bulk of
// a chunk's exps; a hardware approximation where the products are bf16 anyway).
struct SerialTeam {
  KDA_HD int rank() const { return 0; }
  KDA_HD int size() const { return 1; }
  KDA_HD void sync() const {}
  KDA_HD void atomic_min(int* at, int value) const { *at = value < *at ? value : *at; }
  template <typename T>
  KDA_HD void gemm(int M, int N, int Kn, T alpha, View<T> A, View<T> B, Out<T> C, Prior<T> prior = Prior<T>{},
                   const T* kscale = nullptr) const {
    team_gemm(*this, M, N, Kn, alpha, A, B, C, prior, kscale);
  }
  template <typename T>
  KDA_HD T pair_exp(T x) const {
    return exp_of(x);
  }
  template <typename T>
  KDA_HD void gemm_fp32(int M, int N, int Kn, T alpha, View<T> A, View<T> B, Out<T> C, Prior<T> prior = Prior<T>{},
                        const T* kscale = nullptr) const {
    team_gemm(*this, M, N, Kn, alpha, A, B, C, prior, kscale);
  }
};

constexpr int kSub = 16;  // A, Aqk: diagonal blocks computed pair by pair
static_assert(kChunk == 4 * kSub, "chunk_intra's scratch layout holds three block rows below the first");

// Elements of chunk_intra's scratch: kSub rows of kChunk, or 3 kSub rows of K.
KDA_HD int intra_scratch(int K) { return kSub * kChunk > 3 * kSub * K ? kSub * kChunk : 3 * kSub * K; }

// Everything of a chunk that does not depend on the state.
// In: q, k [L,K]; G (chunk_cumsum); v [L,V]; beta [L]. Out: A, Aqk, Minv [L,kChunk] (entries
// above the diagonal are zero, Minv's diagonal one); W, Qg, Kd [L,K]; Ut [L,V]; gC [K].
// Y [intra_scratch(K)] is scratch.
template <typename T, typename Team>
KDA_HD void chunk_intra(const Team& tm, ChunkDims d, const T* q, const T* k, Gates<T> G, const T* v, const T* beta,
                        T* A, T* Aqk, T* Minv, T* W, T* Ut, T* Qg, T* Kd, T* gC, T* Y) {
  const int L = d.L, K = d.K, V = d.V;
  // Rows scaled to the first row r of their block: k exp(G_t - G_r) into Kd, q exp(G_t - G_r)
  // into Qg (scratch until the end).
  for (int i = tm.rank(); i < L * K; i += tm.size()) {
    const int t = i / K, c = i % K, r = t / kSub * kSub;
    const T e = G.exp_diff(i, r * K + c);
    Kd[i] = k[i] * e;
    Qg[i] = q[i] * e;
  }
  // Diagonal blocks, pair by pair over the pairs s <= t of each block (136 of a full block's
  // 256, so that every member has work); the members of a warp start at different c (no bank
  // conflicts). Entries right of the diagonal are zero.
  constexpr int kPairs = kSub * (kSub + 1) / 2;
  for (int i = tm.rank(); i < (L + kSub - 1) / kSub * kPairs; i += tm.size()) {
    const int b0 = i / kPairs * kSub, pair = i % kPairs;
    int dt = 0;
    while ((dt + 1) * (dt + 2) / 2 <= pair) ++dt;
    const int t = b0 + dt, s = b0 + pair - dt * (dt + 1) / 2;
    if (t >= L) continue;
    T a = 0, b = 0;
    const int start = s % K;
    for (int cc = 0; cc < K; ++cc) {
      const int c = cc + start < K ? cc + start : cc + start - K;
      const T e = tm.pair_exp(G.diff(t * K + c, s * K + c)) * k[s * K + c];
      a += k[t * K + c] * e;
      b += q[t * K + c] * e;
    }
    A[t * kChunk + s] = s < t ? a : T(0);
    Aqk[t * kChunk + s] = b;
  }
  for (int i = tm.rank(); i < L * L; i += tm.size()) {
    const int t = i / L, s = i % L;
    if (s > t) A[t * kChunk + s] = Aqk[t * kChunk + s] = 0;
  }
  // Blocks left of the diagonal, block row b = [r, r + kSub): A[b, :r] = Kd[b] X_r^T and
  // Aqk[b, :r] = Qg[b] X_r^T with X_r = k_s exp(G_r - G_s) for s < r. The three X_r (16, 32 and
  // 48 rows) sit in Y[0, 16), Y[16, 48) and W[0, 48) (W has L > 48 rows when X_48 exists), so
  // that all six products run in one pass.
  const auto keys_of = [&](int r) { return r == 3 * kSub ? W : Y + (r - kSub) * K; };
  for (int r = kSub; r < L; r += kSub) {
    T* X = keys_of(r);
    for (int i = tm.rank(); i < r * K; i += tm.size()) X[i] = k[i] * G.exp_diff(r * K + i % K, i);
  }
  tm.sync();
  for (int r = kSub; r < L; r += kSub) {
    const int n = L - r < kSub ? L - r : kSub;
    tm.gemm(n, r, K, T(1), rows_of(Kd + r * K, K), cols_of<T>(keys_of(r), K), out_rows(A + r * kChunk, kChunk));
    tm.gemm(n, r, K, T(1), rows_of(Qg + r * K, K), cols_of<T>(keys_of(r), K), out_rows(Aqk + r * kChunk, kChunk));
  }
  tm.sync();
  // Minv = (I + diag(beta) A)^-1 by kSub x kSub blocks. The diagonal blocks D_b by substitution,
  // one column per member (x_s = 1, x_t = -beta_t sum_{s<=u<t} A_tu x_u within the block), with
  // the zeros right of them; then block row by block row below:
  // Minv[b, :b] = -D_b diag(beta_b) A[b, :b] Minv[:b, :b], through Y = A[b, :b] Minv[:b, :b]
  // (products at fp32 accuracy in every precision mode: the inverse is not an operand rounding).
  for (int s = tm.rank(); s < L; s += tm.size()) {
    const int b1 = s / kSub * kSub + kSub < L ? s / kSub * kSub + kSub : L;
    for (int t = 0; t < s; ++t) Minv[t * kChunk + s] = 0;
    Minv[s * kChunk + s] = 1;
    for (int t = s + 1; t < b1; ++t) {
      T acc = 0;
      for (int u = s; u < t; ++u) acc += A[t * kChunk + u] * Minv[u * kChunk + s];
      Minv[t * kChunk + s] = -beta[t] * acc;
    }
  }
  tm.sync();
  for (int r = kSub; r < L; r += kSub) {
    const int n = L - r < kSub ? L - r : kSub;
    tm.gemm_fp32(n, r, r, T(1), rows_of(A + r * kChunk, kChunk), rows_of<T>(Minv, kChunk), out_rows(Y, kChunk));
    tm.sync();
    tm.gemm_fp32(n, r, n, T(-1), rows_of<T>(Minv + r * kChunk + r, kChunk), rows_of<T>(Y, kChunk),
                 out_rows(Minv + r * kChunk, kChunk), Prior<T>{}, beta + r);
    tm.sync();
  }
  for (int i = tm.rank(); i < L * K; i += tm.size()) Qg[i] = k[i] * G.exp_at(i);  // k exp(G), scratch
  tm.sync();
  tm.gemm(L, K, L, T(1), rows_of<T>(Minv, kChunk), rows_of<T>(Qg, K), out_rows(W, K), Prior<T>{}, beta);
  tm.gemm(L, V, L, T(1), rows_of<T>(Minv, kChunk), rows_of(v, V), out_rows(Ut, V), Prior<T>{}, beta);
  tm.sync();
  for (int i = tm.rank(); i < L * K; i += tm.size()) {
    Qg[i] = q[i] * G.exp_at(i);
    Kd[i] = k[i] * G.exp_diff((L - 1) * K + i % K, i);
  }
  for (int c = tm.rank(); c < K; c += tm.size()) gC[c] = G.exp_at((L - 1) * K + c);
  tm.sync();
}

// One chunk of state passing over a tile of Vt state columns (S [K,Vt] with leading dim ldS;
// Ut, O, U rows with leading dims ldU, ldO, Vt). Writes O (skip with nullptr) and advances S;
// mark (the tile's columns of chunk_mark_nonfinite's marks; nullptr for none or a clean chunk)
// then puts its NaNs.
template <typename T, typename Team>
KDA_HD void chunk_state_fwd(const Team& tm, ChunkDims d, T scale, const T* W, const T* Ut, int ldU, const T* Qg,
                            const T* Kd, const T* Aqk, const T* gC, T* S, int ldS, T* U, T* O, int ldO,
                            const unsigned char* mark = nullptr) {
  const int L = d.L, K = d.K, Vt = d.V;
  tm.gemm(L, Vt, K, T(-1), rows_of(W, K), rows_of<T>(S, ldS), out_rows(U, Vt), Prior<T>{T(1), nullptr, Ut, ldU});
  if (O != nullptr) tm.gemm(L, Vt, K, scale, rows_of(Qg, K), rows_of<T>(S, ldS), out_rows(O, ldO));
  tm.sync();
  if (O != nullptr) {
    tm.gemm(L, Vt, L, scale, rows_of(Aqk, kChunk), rows_of<T>(U, Vt), out_rows(O, ldO), plus_c<T>());
  }
  tm.gemm(K, Vt, L, T(1), cols_of(Kd, K), rows_of<T>(U, Vt), out_rows(S, ldS), Prior<T>{T(0), gC, nullptr, 0});
  tm.sync();
  if (mark != nullptr) apply_marks(tm, d, mark, O, ldO, S, ldS);
}

// One chunk of the state gradient, backwards, over a tile of Vt columns: dS holds dS1 (the
// gradient of the chunk's end state) on entry and dS0 on exit. dO [L,Vt] (leading dim ldO);
// dU [L,Vt] is scratch.
template <typename T, typename Team>
KDA_HD void chunk_state_bwd(const Team& tm, ChunkDims d, T scale, const T* W, const T* Qg, const T* Kd,
                            const T* Aqk, const T* gC, const T* dO, int ldO, T* dS, int ldS, T* dU) {
  const int L = d.L, K = d.K, Vt = d.V;
  tm.gemm(L, Vt, L, scale, cols_of(Aqk, kChunk), rows_of(dO, ldO), out_rows(dU, Vt));
  tm.gemm(L, Vt, K, T(1), rows_of(Kd, K), rows_of<T>(dS, ldS), out_rows(dU, Vt), plus_c<T>());
  tm.sync();
  tm.gemm(K, Vt, L, scale, cols_of(Qg, K), rows_of(dO, ldO), out_rows(dS, ldS), Prior<T>{T(0), gC, nullptr, 0});
  tm.gemm(K, Vt, L, T(-1), cols_of(W, K), rows_of<T>(dU, Vt), out_rows(dS, ldS), plus_c<T>());
  tm.sync();
}

// Scratch of chunk_bwd, each [L, width] row-major.
template <typename T>
struct ChunkBwdScratch {
  T* U;     // [L,V]  U = Ut - W S0
  T* dU;    // [L,V]
  T* dW;    // [L,K]
  T* ZW;    // [L,K]  Minv^T dW
  T* ZU;    // [L,V]  Minv^T dU
  T* dAqk;  // [L,kChunk]
  T* dA;    // [L,kChunk]
  T* last;  // [K]    extra gradient of G at the chunk's last step
  T* kE;    // [L,K]  k, q scaled to the first row of their block
  T* qE;    // [L,K]
  T* Y;     // [2 kSub, K]
};

// The chunk backward in two parts. chunk_bwd_dense: the products with the states, given the
// chunk's start state S0 [K,V], the gradient dS1 [K,V] of its end state and dO [L,V] (leading
// dim ldO); intra-chunk quantities as from chunk_intra. Leaves dQg in dq and dKd in dk [L,K],
// dAqk (zero for s > t) and dA = -(ZW W^T + ZU Ut^T) (zero for s >= t) [L,kChunk], ZW = Minv^T dW
// [L,K], sc.last [K] = sum_j dS1 S0, and writes dv [L,V] (leading dim ldv) and the first term of
// dbeta [L], sum_j ZU v.
template <typename T, typename Team>
KDA_HD void chunk_bwd_dense(const Team& tm, ChunkDims d, T scale, const T* v, const T* beta, const T* Aqk,
                            const T* Minv, const T* W, const T* Ut, const T* Kd, const T* S0, const T* dS1,
                            const T* dO, int ldO, ChunkBwdScratch<T> sc, T* dq, T* dk, T* dv, int ldv, T* dbeta) {
  const int L = d.L, K = d.K, V = d.V;
  // U = Ut - W S0 and dU = scale Aqk^T dO + Kd dS1.
  tm.gemm(L, V, K, T(-1), rows_of(W, K), rows_of(S0, V), out_rows(sc.U, V), Prior<T>{T(1), nullptr, Ut, V});
  tm.gemm(L, V, L, scale, cols_of(Aqk, kChunk), rows_of(dO, ldO), out_rows(sc.dU, V));
  tm.gemm(L, V, K, T(1), rows_of(Kd, K), rows_of(dS1, V), out_rows(sc.dU, V), plus_c<T>());
  tm.sync();
  // Reductions over V: dQg into dq, dKd into dk, dW, and dAqk = scale dO U^T.
  tm.gemm(L, K, V, scale, rows_of(dO, ldO), cols_of(S0, V), out_rows(dq, K));
  tm.gemm(L, K, V, T(1), rows_of<T>(sc.U, V), cols_of(dS1, V), out_rows(dk, K));
  tm.gemm(L, K, V, T(-1), rows_of<T>(sc.dU, V), cols_of(S0, V), out_rows(sc.dW, K));
  tm.gemm(L, L, V, scale, rows_of(dO, ldO), cols_of<T>(sc.U, V), out_rows(sc.dAqk, kChunk));
  tm.sync();
  // Through the solve: Z = Minv^T dY. The first part of G_last's extra gradient: sum_j dS1 S0.
  tm.gemm(L, K, L, T(1), cols_of(Minv, kChunk), rows_of<T>(sc.dW, K), out_rows(sc.ZW, K));
  tm.gemm(L, V, L, T(1), cols_of(Minv, kChunk), rows_of<T>(sc.dU, V), out_rows(sc.ZU, V));
  for (int c = tm.rank(); c < K; c += tm.size()) {
    T acc = 0;
    for (int j = 0; j < V; ++j) acc += dS1[c * V + j] * S0[c * V + j];
    sc.last[c] = acc;
  }
  for (int i = tm.rank(); i < L * L; i += tm.size()) {
    const int t = i / L, s = i % L;
    if (s > t) sc.dAqk[t * kChunk + s] = 0;
  }
  tm.sync();
  // dM = -(ZW W^T + ZU Ut^T) (kept for s < t); dv = diag(beta) ZU.
  tm.gemm(L, L, K, T(-1), rows_of<T>(sc.ZW, K), cols_of(W, K), out_rows(sc.dA, kChunk));
  tm.gemm(L, L, V, T(-1), rows_of<T>(sc.ZU, V), cols_of(Ut, V), out_rows(sc.dA, kChunk), plus_c<T>());
  for (int i = tm.rank(); i < L * V; i += tm.size()) dv[(i / V) * ldv + i % V] = beta[i / V] * sc.ZU[i];
  tm.sync();
  for (int t = tm.rank(); t < L; t += tm.size()) {
    T acc = 0;
    for (int j = 0; j < V; ++j) acc += sc.ZU[t * V + j] * v[t * V + j];
    dbeta[t] = acc;
  }
  for (int i = tm.rank(); i < L * L; i += tm.size()) {
    const int t = i / L, s = i % L;
    if (s >= t) sc.dA[t * kChunk + s] = 0;
  }
  tm.sync();
}

// chunk_bwd_dense's results to the gradients: dq, dk (w.r.t. the normalised q, k), dg [L,K] and
// dbeta [L] (its first term already there). sc.last and sc.dA are overwritten.
template <typename T, typename Team>
KDA_HD void chunk_bwd_pairs(const Team& tm, ChunkDims d, const T* q, const T* k, Gates<T> G, const T* beta,
                            const T* A, const T* Qg, const T* Kd, const T* gC, ChunkBwdScratch<T> sc, T* dq, T* dk,
                            T* dg, T* dbeta) {
  const int L = d.L, K = d.K;
  // G_last's extra gradient through Kd and gC: gC sum_j dS1 S0 + sum_t Kd dKd.
  for (int c = tm.rank(); c < K; c += tm.size()) {
    T acc = sc.last[c] * gC[c];
    for (int t = 0; t < L; ++t) acc += Kd[t * K + c] * dk[t * K + c];
    sc.last[c] = acc;
  }
  tm.sync();
  for (int i = tm.rank(); i < L * K; i += tm.size()) {
    const T dqg = dq[i], dkd = dk[i];
    dq[i] = dqg * G.exp_at(i);
    dk[i] = dkd * G.exp_diff((L - 1) * K + i % K, i);
    dg[i] = dqg * Qg[i] - dkd * Kd[i];
  }
  for (int t = tm.rank(); t < L; t += tm.size()) {
    T acc = dbeta[t];
    for (int c = 0; c < K; ++c) acc += sc.ZW[t * K + c] * k[t * K + c] * G.exp_at(t * K + c);
    for (int s = 0; s < t; ++s) acc += sc.dA[t * kChunk + s] * A[t * kChunk + s];
    dbeta[t] = acc;
  }
  tm.sync();
  for (int i = tm.rank(); i < L * L; i += tm.size()) {
    const int t = i / L, s = i % L;
    sc.dA[t * kChunk + s] = s < t ? beta[t] * sc.dA[t * kChunk + s] : T(0);
  }
  tm.sync();
  // Through A and Aqk, and k exp(G) (the W columns). Per element (t, c), with E_ts = exp(G_t - G_s):
  //   p_row_a = sum_{s<t} dA_ts k_s E_ts,  p_row_q = sum_{s<=t} dAqk_ts k_s E_ts,
  //   p_col = sum_{r>=t} (dA_rt k_r + dAqk_rt q_r) E_rt,
  //   dq += p_row_q,  dk += p_row_a + p_col,  dg += k p_row_a + q p_row_q - k p_col.
  // Pairs inside a diagonal block: one by one. Pairs across blocks: through the first row of the
  // later block, as in chunk_intra.
  for (int i = tm.rank(); i < L * K; i += tm.size()) {
    const int t = i / K, c = i % K, b0 = t / kSub * kSub, b1 = b0 + kSub < L ? b0 + kSub : L;
    T p_row_a = 0, p_row_q = 0, p_col = 0;
    for (int s = b0; s <= t; ++s) {
      const T e = tm.pair_exp(G.diff(i, s * K + c)) * k[s * K + c];
      p_row_a += sc.dA[t * kChunk + s] * e;
      p_row_q += sc.dAqk[t * kChunk + s] * e;
    }
    for (int r = t; r < b1; ++r) {
      const T e = tm.pair_exp(G.diff(r * K + c, i));
      p_col += (sc.dA[r * kChunk + t] * k[r * K + c] + sc.dAqk[r * kChunk + t] * q[r * K + c]) * e;
    }
    const T kt = k[i], qt = q[i], eg = G.exp_at(i), zw = beta[t] * sc.ZW[i];
    dq[i] += p_row_q;
    dk[i] += p_row_a + p_col + zw * eg;
    dg[i] += kt * p_row_a + qt * p_row_q - kt * p_col + zw * kt * eg;
    const T e0 = G.exp_diff(i, b0 * K + c);
    sc.kE[i] = kt * e0;
    sc.qE[i] = qt * e0;
  }
  tm.sync();
  T* Ks = sc.dW;  // k_s exp(G_r - G_s) for s < r (dW is spent)
  T* X = sc.ZW;   // column terms of the rows s < r before their factor (ZW is spent)
  T *Ya = sc.Y, *Yq = sc.Y + kSub * K;
  for (int r = kSub; r < L; r += kSub) {
    const int n = L - r < kSub ? L - r : kSub;
    for (int i = tm.rank(); i < r * K; i += tm.size()) Ks[i] = k[i] * G.exp_diff(r * K + i % K, i);
    tm.sync();
    tm.gemm(n, K, r, T(1), rows_of<T>(sc.dA + r * kChunk, kChunk), rows_of<T>(Ks, K), out_rows(Ya, K));
    tm.gemm(n, K, r, T(1), rows_of<T>(sc.dAqk + r * kChunk, kChunk), rows_of<T>(Ks, K), out_rows(Yq, K));
    tm.gemm(r, K, n, T(1), cols_of<T>(sc.dA + r * kChunk, kChunk), rows_of<T>(sc.kE + r * K, K), out_rows(X, K));
    tm.gemm(r, K, n, T(1), cols_of<T>(sc.dAqk + r * kChunk, kChunk), rows_of<T>(sc.qE + r * K, K), out_rows(X, K),
            plus_c<T>());
    tm.sync();
    for (int i = tm.rank(); i < n * K; i += tm.size()) {  // rows of the block: row terms
      const int at = r * K + i, c = i % K;
      const T e = G.exp_diff(at, r * K + c), pa = e * Ya[i], pq = e * Yq[i];
      dq[at] += pq;
      dk[at] += pa;
      dg[at] += k[at] * pa + q[at] * pq;
    }
    for (int i = tm.rank(); i < r * K; i += tm.size()) {  // rows before it: column terms
      const T pc = G.exp_diff(r * K + i % K, i) * X[i];
      dk[i] += pc;
      dg[i] -= k[i] * pc;
    }
    tm.sync();
  }
  // dg = reverse cumulative sum of dG, with G_last's extra term.
  for (int c = tm.rank(); c < K; c += tm.size()) {
    T run = sc.last[c];
    for (int t = L - 1; t >= 0; --t) {
      run += dg[t * K + c];
      dg[t * K + c] = run;
    }
  }
  tm.sync();
}

// Gradients of one chunk: chunk_bwd_dense then chunk_bwd_pairs.
template <typename T, typename Team>
KDA_HD void chunk_bwd(const Team& tm, ChunkDims d, T scale, const T* q, const T* k, Gates<T> G, const T* v,
                      const T* beta, const T* A, const T* Aqk, const T* Minv, const T* W, const T* Ut, const T* Qg,
                      const T* Kd, const T* gC, const T* S0, const T* dS1, const T* dO, int ldO,
                      ChunkBwdScratch<T> sc, T* dq, T* dk, T* dg, T* dv, int ldv, T* dbeta) {
  chunk_bwd_dense(tm, d, scale, v, beta, Aqk, Minv, W, Ut, Kd, S0, dS1, dO, ldO, sc, dq, dk, dv, ldv, dbeta);
  chunk_bwd_pairs(tm, d, q, k, G, beta, A, Qg, Kd, gC, sc, dq, dk, dg, dbeta);
}

}  // namespace kda_dsa_ops::kda
