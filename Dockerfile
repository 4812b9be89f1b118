# attnd in a container: a multi-stage image, for an NVIDIA GPU host by default or the CPU alone.
#
#   docker build -t attnd:0.1.0 .                        # GPU: CUDA 13.0, sm_80 and sm_90
#   docker run --rm --gpus all -p 127.0.0.1:50051:50051 -p 127.0.0.1:8080:8080 attnd:0.1.0
#   docker build -t attnd:0.1.0-cpu --build-arg BASE_BUILD=debian:12 \
#     --build-arg BASE_RUNTIME=debian:12 --build-arg ATTN_CUDA=OFF .   # CPU only
# KV caches that survive a restart: a volume on /var/lib/attnd/caches and --cache-dir on it, e.g.
#   docker run -d --gpus all -p 127.0.0.1:50051:50051 -p 127.0.0.1:8080:8080 \
#     -v attnd-caches:/var/lib/attnd/caches attnd:0.1.0 --listen 0.0.0.0:50051 \
#     --http-listen 0.0.0.0:8080 --device auto --insecure --cache-dir /var/lib/attnd/caches
#
# Build arguments, one Dockerfile for both images:
#   BASE_BUILD, BASE_RUNTIME  the bases of the two stages: the pinned nvidia/cuda devel and runtime
#                             images (Ubuntu 24.04; both must stay on the same CUDA release), or
#                             for the CPU image one Debian 12 image for both
#   ATTN_CUDA                 ON: the CUDA backend is required (sm_80 A100, sm_90 H100/H200);
#                             OFF: the CPU backend only, for a base without nvcc
#
# Build stage: the same recipe as tests/run.sh and CI, one recipe not two: deploy/install-deps.sh
# installs the packages (ATTN_DEPS=build leaves out the test-only browser, Node, fuzz and
# container tools), then the "release" CMake preset builds attnd and attn.
# Runtime stage: the base (for the GPU image it brings cudart and cuBLAS) plus only the shared
# libraries attnd and attn link, installed by the same script (ATTN_DEPS=runtime), which picks
# Debian 12's or Ubuntu 24.04's package names from /etc/os-release.
#
# What has been run: tests/image_test.sh (a stage of tests/run.sh, so CI on every change) builds
# the CPU image on a Debian 12 base made with debootstrap and runs it: non-root, read-only root,
# HEALTHCHECK, Naive/Tiled/Trace and caches from the client outside, the --insecure rule, token
# and TLS, drain on `docker stop`, caches kept across `docker stop` and `docker start` in a volume
# for --cache-dir, and deploy/compose.yaml. The GPU image has NOT been built:
# these machines reach no image registry (so no nvidia/cuda base) and no Ubuntu package
# registry, so its Ubuntu 24.04 package names are unverified by any install (install-deps.sh).
# tests/deploy_static_test.py checks this file statically against the CI recipe.

ARG BASE_BUILD=nvidia/cuda:13.0.1-devel-ubuntu24.04
ARG BASE_RUNTIME=nvidia/cuda:13.0.1-runtime-ubuntu24.04

FROM ${BASE_BUILD} AS build
ARG ATTN_CUDA=ON
WORKDIR /src
# The install script alone first: its layer (the packages, most of a minute) stays cached while
# only the sources change.
COPY deploy/install-deps.sh deploy/
RUN ATTN_DEPS=build ./deploy/install-deps.sh \
 && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cmake --preset release -DATTN_CUDA=${ATTN_CUDA} -DCMAKE_CUDA_ARCHITECTURES="80;90" \
 && cmake --build --preset release --target attnd attn -j"$(nproc)"

FROM ${BASE_RUNTIME} AS runtime
COPY deploy/install-deps.sh /tmp/
RUN ATTN_DEPS=runtime /tmp/install-deps.sh \
 && rm -rf /var/lib/apt/lists/* /tmp/install-deps.sh \
 && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin attnd \
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/attnd /var/lib/attnd/caches
COPY --from=build /src/build/release/attnd /src/build/release/attn /usr/local/bin/
# /var/lib/attnd/caches: where deploy/compose.yaml and deploy/k8s mount a volume for
# --cache-dir, owned by uid 10001 (attnd writes its cache files there). A new, empty Docker
# volume mounted on it takes this directory's owner and mode, so attnd can write to it under a
# read-only root; a Kubernetes volume gets its group from the pod's fsGroup instead. No VOLUME
# line: without --cache-dir (the default below) nothing is written there, and an anonymous
# volume per `docker run` would only pile up.

# A numeric user, so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
USER 10001:10001
# 50051: gRPC (attention.v1, grpc.health.v1, reflection). 8080: HTTP (/healthz, /readyz,
# /metrics, the JSON gateway and the viewer).
EXPOSE 50051 8080
# grpc.health.v1 needs no token, so the check works with --auth-token-file too.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["attn", "--target", "127.0.0.1:50051", "--timeout-ms", "3000", "health"]

ENTRYPOINT ["attnd"]
# attnd refuses plaintext on a non-loopback address unless told --insecure: a --listen without
# TLS, and any --http-listen (the HTTP port has no TLS). The default below binds both ports on
# 0.0.0.0 (a published port reaches the container's address, not its loopback), so its one
# --insecure covers both. It is for trying the image on a trusted host or network; in
# production replace these arguments, e.g. mount certificates and a token (files readable by
# uid 10001, in directories it can enter) and run
#   attnd --listen 0.0.0.0:50051 --http-listen 127.0.0.1:8080 --device auto \
#         --tls-cert /certs/tls.crt --tls-key /certs/tls.key --auth-token-file /secrets/token
# which keeps the plain-HTTP port inside the container (to publish it to a trusted network, give
# --http-listen 0.0.0.0:8080 and --insecure, which with TLS on gRPC covers only --http-listen).
# The HEALTHCHECK above then needs the CA too, e.g. `docker run --health-cmd "attn --target
# 127.0.0.1:50051 --tls-ca /certs/ca.crt --timeout-ms 3000 health"` with a server certificate
# for 127.0.0.1, or use /healthz on 127.0.0.1:8080 instead.
CMD ["--listen", "0.0.0.0:50051", "--http-listen", "0.0.0.0:8080", "--device", "auto", "--insecure"]
