// KDA on the CPU: the chunked algorithm of kda_chunk.h, one task per (sequence, value head),
// chunks in order, the state in host memory.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "kda/kda.h"
#include "kda/kda_chunk.h"

namespace kda_dsa_ops::kda {

namespace {

// Where sequence n lies in the flattened [B*T] tokens.
std::vector<std::pair<int64_t, int64_t>> sequences(const Problem& p) {
  std::vector<std::pair<int64_t, int64_t>> seqs;
  if (p.cu_seqlens.defined()) {
    const int32_t* cu = p.cu_seqlens.data_ptr<int32_t>();
    for (int64_t n = 0; n < p.N; ++n) seqs.emplace_back(cu[n], cu[n + 1] - cu[n]);
  } else {
    for (int64_t n = 0; n < p.N; ++n) seqs.emplace_back(n * p.T, p.T);
  }
  return seqs;
}

// One chunk's working set for one value head, in host memory.
template <typename T>
struct ChunkWork {
  int K, V;
  std::vector<T> q, k, G, Glo, v, beta, A, Aqk, Minv, W, Ut, Qg, Kd, gC, Y;
  ChunkWork(int K_, int V_)
      : K(K_), V(V_), q(kChunk * K), k(kChunk * K), G(kChunk * K), Glo(kChunk * K), v(kChunk * V), beta(kChunk),
        A(kChunk * kChunk), Aqk(kChunk * kChunk), Minv(kChunk * kChunk), W(kChunk * K), Ut(kChunk * V), Qg(kChunk * K),
        Kd(kChunk * K), gC(K), Y(intra_scratch(K_)) {}

  Gates<T> gates() const { return {G.data(), Glo.data()}; }

  // Load steps [t0, t0 + L) of value head hv (query/key head h) and compute the intra-chunk terms;
  // for the forward (mark: V + 1 entries) with finite stand-ins for non-finite inputs.
  void load(const Problem& p, const Inputs& in, int64_t t0, int L, int64_t h, int64_t hv,
            unsigned char* mark = nullptr) {
    const T* qp = in.q.data_ptr<T>();
    const T* kp = in.k.data_ptr<T>();
    const T* vp = in.v.data_ptr<T>();
    const T* gp = in.g.data_ptr<T>();
    const T* bp = in.beta.data_ptr<T>();
    for (int t = 0; t < L; ++t) {
      const int64_t tok = t0 + t;
      std::copy_n(qp + (tok * p.H + h) * K, K, q.data() + t * K);
      std::copy_n(kp + (tok * p.H + h) * K, K, k.data() + t * K);
      std::copy_n(gp + (tok * p.HV + hv) * K, K, G.data() + t * K);
      std::copy_n(vp + (tok * p.HV + hv) * V, V, v.data() + t * V);
      beta[t] = bp[tok * p.HV + hv];
    }
    const SerialTeam tm;
    const ChunkDims d{L, K, V};
    if (mark != nullptr) {
      chunk_mark_nonfinite(tm, d, k.data(), G.data(), v.data(), beta.data(), reinterpret_cast<int*>(Y.data()), mark);
    }
    chunk_cumsum(tm, d, G.data(), Glo.data());
    chunk_intra(tm, d, q.data(), k.data(), gates(), v.data(), beta.data(), A.data(), Aqk.data(), Minv.data(), W.data(),
                Ut.data(), Qg.data(), Kd.data(), gC.data(), Y.data());
  }
};

template <typename T>
void fwd_impl(const Problem& p, const Inputs& in, at::Tensor& o, at::Tensor& final_state) {
  const auto seqs = sequences(p);
  const int K = static_cast<int>(p.K), V = static_cast<int>(p.V);
  const int64_t group = p.HV / p.H;
  T* op = o.data_ptr<T>();
  at::parallel_for(0, p.N * p.HV, 1, [&](int64_t begin, int64_t end) {
    ChunkWork<T> w(K, V);
    std::vector<T> S(K * V), U(kChunk * V);
    std::vector<unsigned char> mark(V + 1);
    const SerialTeam tm;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / p.HV, hv = task % p.HV;
      const auto [bos, len] = seqs[n];
      if (in.initial_state.defined()) {
        std::copy_n(in.initial_state.data_ptr<T>() + task * K * V, K * V, S.data());
      } else {
        std::fill(S.begin(), S.end(), T(0));
      }
      for (int64_t t0 = 0; t0 < len; t0 += kChunk) {
        const int L = static_cast<int>(std::min<int64_t>(kChunk, len - t0));
        w.load(p, in, bos + t0, L, hv / group, hv, mark.data());
        chunk_state_fwd(tm, ChunkDims{L, K, V}, static_cast<T>(p.scale), w.W.data(), w.Ut.data(), V, w.Qg.data(),
                        w.Kd.data(), w.Aqk.data(), w.gC.data(), S.data(), V, U.data(),
                        op + ((bos + t0) * p.HV + hv) * V, static_cast<int>(p.HV * V),
                        mark[V] < L ? mark.data() : nullptr);
      }
      if (final_state.defined()) std::copy_n(S.data(), K * V, final_state.data_ptr<T>() + task * K * V);
    }
  });
}

template <typename T>
void bwd_impl(const Problem& p, const Inputs& in, const at::Tensor& grad_o, const at::Tensor& grad_final_state,
              Grads& gr) {
  const auto seqs = sequences(p);
  const int K = static_cast<int>(p.K), V = static_cast<int>(p.V);
  const int64_t group = p.HV / p.H;
  const T scale = static_cast<T>(p.scale);
  at::parallel_for(0, p.N * p.HV, 1, [&](int64_t begin, int64_t end) {
    ChunkWork<T> w(K, V);
    std::vector<T> S(K * V), dS(K * V), U(kChunk * V), dU(kChunk * V), dW(kChunk * K), ZW(kChunk * K),
        ZU(kChunk * V), dAqk(kChunk * kChunk), dA(kChunk * kChunk), last(K), kE(kChunk * K), qE(kChunk * K),
        Y(2 * kSub * K), dq(kChunk * K), dk(kChunk * K), dg(kChunk * K), dv(kChunk * V), dbeta(kChunk),
        dO(kChunk * V);
    const ChunkBwdScratch<T> sc{U.data(),   dU.data(),  dW.data(), ZW.data(), ZU.data(), dAqk.data(),
                                dA.data(),  last.data(), kE.data(), qE.data(), Y.data()};
    std::vector<T> starts;  // the start state of every chunk, recomputed
    const SerialTeam tm;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / p.HV, hv = task % p.HV, h = hv / group;
      const auto [bos, len] = seqs[n];
      const int64_t chunks = (len + kChunk - 1) / kChunk;
      starts.resize(static_cast<size_t>(chunks) * K * V);
      if (in.initial_state.defined()) {
        std::copy_n(in.initial_state.data_ptr<T>() + task * K * V, K * V, S.data());
      } else {
        std::fill(S.begin(), S.end(), T(0));
      }
      for (int64_t c = 0; c < chunks; ++c) {
        const int L = static_cast<int>(std::min<int64_t>(kChunk, len - c * kChunk));
        w.load(p, in, bos + c * kChunk, L, h, hv);
        std::copy_n(S.data(), K * V, starts.data() + c * K * V);
        chunk_state_fwd(tm, ChunkDims{L, K, V}, scale, w.W.data(), w.Ut.data(), V, w.Qg.data(), w.Kd.data(),
                        w.Aqk.data(), w.gC.data(), S.data(), V, U.data(), static_cast<T*>(nullptr), V);
      }
      if (grad_final_state.defined()) {
        std::copy_n(grad_final_state.data_ptr<T>() + task * K * V, K * V, dS.data());
      } else {
        std::fill(dS.begin(), dS.end(), T(0));
      }
      for (int64_t c = chunks - 1; c >= 0; --c) {
        const int L = static_cast<int>(std::min<int64_t>(kChunk, len - c * kChunk));
        const int64_t t0 = bos + c * kChunk;
        w.load(p, in, t0, L, h, hv);
        for (int t = 0; t < L; ++t) {
          std::copy_n(grad_o.data_ptr<T>() + ((t0 + t) * p.HV + hv) * V, V, dO.data() + t * V);
        }
        const ChunkDims d{L, K, V};
        chunk_bwd(tm, d, scale, w.q.data(), w.k.data(), w.gates(), w.v.data(), w.beta.data(), w.A.data(),
                  w.Aqk.data(), w.Minv.data(), w.W.data(), w.Ut.data(), w.Qg.data(), w.Kd.data(), w.gC.data(),
                  starts.data() + c * K * V, dS.data(), dO.data(), V, sc, dq.data(), dk.data(), dg.data(), dv.data(),
                  V, dbeta.data());
        chunk_state_bwd(tm, d, scale, w.W.data(), w.Qg.data(), w.Kd.data(), w.Aqk.data(), w.gC.data(), dO.data(), V,
                        dS.data(), V, dU.data());
        for (int t = 0; t < L; ++t) {
          const int64_t row = (t0 + t) * p.HV + hv;
          std::copy_n(dq.data() + t * K, K, gr.dq.data_ptr<T>() + row * K);
          std::copy_n(dk.data() + t * K, K, gr.dk.data_ptr<T>() + row * K);
          std::copy_n(dg.data() + t * K, K, gr.dg.data_ptr<T>() + row * K);
          std::copy_n(dv.data() + t * V, V, gr.dv.data_ptr<T>() + row * V);
          gr.dbeta.data_ptr<T>()[row] = dbeta[t];
        }
      }
      std::copy_n(dS.data(), K * V, gr.dinitial_state.data_ptr<T>() + task * K * V);
    }
  });
}

}  // namespace

void fwd_cpu(const Problem& p, const Inputs& in, at::Tensor& o, at::Tensor& final_state) {
  if (o.scalar_type() == at::kDouble) {
    fwd_impl<double>(p, in, o, final_state);
  } else {
    fwd_impl<float>(p, in, o, final_state);
  }
}

void bwd_cpu(const Problem& p, const Inputs& in, const at::Tensor& grad_o, const at::Tensor& grad_final_state,
             Grads& grads) {
  if (grads.dq.scalar_type() == at::kDouble) {
    bwd_impl<double>(p, in, grad_o, grad_final_state, grads);
  } else {
    bwd_impl<float>(p, in, grad_o, grad_final_state, grads);
  }
}

}  // namespace kda_dsa_ops::kda
