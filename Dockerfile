# attnd on an NVIDIA GPU host: a multi-stage image.
#
#   docker build -t attnd .
#   docker run --rm --gpus all -p 50051:50051 -p 8080:8080 attnd
#
# Build stage: the same recipe as tests/run.sh and CI, one recipe not two: deploy/install-deps.sh
# installs the packages (ATTN_DEPS=build leaves out the test-only browser, Node and fuzz
# toolchain), then the "release" CMake preset builds attnd and attn, here with the CUDA backend
# required (ATTN_CUDA=ON) for sm_80 (A100) and sm_90 (H100/H200).
# Runtime stage: the matching CUDA runtime image (cudart, cuBLAS) plus only the shared libraries
# attnd and attn link (`ldd build/release/attnd build/release/attn`), as Ubuntu 24.04 packages.
#
# The tags are pinned exactly; the build and runtime stages must stay on the same CUDA release.
# tests/deploy_static_test.py checks this file statically (no Docker engine runs in CI).

FROM nvidia/cuda:13.0.1-devel-ubuntu24.04 AS build
WORKDIR /src
COPY . .
RUN ATTN_DEPS=build ./deploy/install-deps.sh \
 && rm -rf /var/lib/apt/lists/*
RUN cmake --preset release -DATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="80;90" \
 && cmake --build --preset release --target attnd attn -j"$(nproc)"

FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04 AS runtime
# gRPC pulls in libgrpc29t64, re2, c-ares and OpenSSL; cpp-httplib brings brotli and zlib;
# OpenBLAS brings libgfortran5. cuBLAS and the CUDA runtime come with the base image.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51t64 libprotobuf32t64 libabsl20220623t64 libopenblas0-pthread \
      libcpp-httplib0.14t64 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin attnd
COPY --from=build /src/build/release/attnd /src/build/release/attn /usr/local/bin/

# A numeric user, so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
USER 10001:10001
# 50051: gRPC (attention.v1, grpc.health.v1, reflection). 8080: HTTP (/healthz, /readyz,
# /metrics, the JSON gateway and the viewer).
EXPOSE 50051 8080
# grpc.health.v1 needs no token, so the check works with --auth-token-file too.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["attn", "--target", "127.0.0.1:50051", "--timeout-ms", "3000", "health"]

ENTRYPOINT ["attnd"]
# attnd refuses plaintext on a non-loopback address unless told --insecure. The default here is
# for trying the image on a trusted host or network; in production replace these arguments,
# e.g. mount certificates and a token and run
#   attnd --listen 0.0.0.0:50051 --http-listen 0.0.0.0:8080 --device auto \
#         --tls-cert /certs/tls.crt --tls-key /certs/tls.key --auth-token-file /secrets/token
# (the HEALTHCHECK above then needs `--tls-ca`, or use /healthz on 8080 instead).
CMD ["--listen", "0.0.0.0:50051", "--http-listen", "0.0.0.0:8080", "--device", "auto", "--insecure"]
