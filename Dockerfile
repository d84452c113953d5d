# gpu-share: the device plugin image. Build: docker build -t ghcr.io/example/gpu-share:0.2.0 .
# Stage 1 builds wheels for gpu-share and its runtime dependencies, at the versions pinned in requirements.lock.
FROM python:3.13-slim-trixie AS build
WORKDIR /src
COPY requirements.lock pyproject.toml README.md ./
COPY deviceplugin ./deviceplugin
RUN pip wheel --no-cache-dir --wheel-dir /wheels --constraint requirements.lock . \
    && cp requirements.lock /wheels/

# Stage 2: the runtime, with only the installed wheels.
FROM python:3.13-slim-trixie
LABEL org.opencontainers.image.title="gpu-share" \
      org.opencontainers.image.description="Kubernetes device plugin that shares GPUs safely" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /wheels /wheels
# Only the wheels built above (--no-index), held to the lock; the version is the package's own.
RUN pip install --no-cache-dir --no-index --find-links=/wheels --constraint /wheels/requirements.lock /wheels/gpu_share-*.whl \
    && rm -rf /wheels \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin gpushare
ENV PYTHONUNBUFFERED=1
# Non-root by default (gpu-share discover, demo, config check need nothing more). The DaemonSet runs the
# plugin as root: the kubelet's device-plugins and pod-resources directories are root-only (0750).
USER 10001
EXPOSE 9410
# `docker run IMAGE` runs the plugin; `docker run IMAGE discover` (demo, config check, ...) any other subcommand.
ENTRYPOINT ["gpu-share"]
CMD ["run"]
