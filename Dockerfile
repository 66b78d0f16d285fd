# syntax=docker/dockerfile:1
# The leasehold image: one static binary that runs both the controller
# (`leasehold controller`) and the workers' sidecar (`leasehold sidecar`).
#
#   docker build -t leasehold:0.1.0 .
#
# Stage 1 builds a statically linked binary for the build platform's musl target;
# stage 2 puts it alone on distroless/static (no shell, no package manager), as a
# non-root user. docs/install.md says which of these steps were checked and how.
#
# Two build arguments let a machine that cannot pull the base images build the same
# final stage (scripts/image does, with podman): BINARY_STAGE names an image that holds
# the binary at /src/out/leasehold in place of the `build` stage, and BASE_IMAGE names an
# image in place of distroless/static (same nonroot user 65532, CA certificates, /tmp).
# The defaults build exactly as without them.

ARG RUST_VERSION=1.95
ARG BINARY_STAGE=build
ARG BASE_IMAGE=gcr.io/distroless/static-debian12:nonroot

FROM rust:${RUST_VERSION}-slim-bookworm AS build
# musl-tools: the C compiler for the musl target, which `ring` (TLS) needs. Debian's
# stable release keeps the package at one upstream version, so it is not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends musl-tools \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY crates ./crates
# The benchmark is a workspace member, so its manifest must be there; it is not built.
COPY bench ./bench
# The target matches the build machine (x86_64 or aarch64), so no cross toolchain is
# needed: build each platform natively (docker buildx build --platform ...).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    target="$(uname -m)-unknown-linux-musl" \
    && rustup target add "$target" \
    && cargo build --release --locked --target "$target" -p leasehold \
    && install -D -m 0755 "target/$target/release/leasehold" out/leasehold

# The stage the binary comes from: `build` above unless BINARY_STAGE names another image.
# hadolint ignore=DL3006
FROM ${BINARY_STAGE} AS binary

# hadolint ignore=DL3006
FROM ${BASE_IMAGE}
COPY --from=binary /src/out/leasehold /usr/local/bin/leasehold
# distroless's `nonroot` user; numeric, so that runAsNonRoot can verify it.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/leasehold"]
CMD ["--help"]
