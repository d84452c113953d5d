# gpu-share: the device plugin image. Build: docker build -t gpu-share:0.1.0 .
# Stage 1 builds wheels for gpu-share and its runtime dependencies (no test extras).
FROM python:3.11.7-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY deviceplugin ./deviceplugin
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# Stage 2: the runtime, with only the installed wheels.
FROM python:3.11.7-slim-bookworm
LABEL org.opencontainers.image.title="gpu-share" \
      org.opencontainers.image.description="Kubernetes device plugin that shares GPUs safely" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels gpu-share==0.1.0 \
    && rm -rf /wheels \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin gpushare
ENV PYTHONUNBUFFERED=1
# Non-root by default (gpu-share discover, demo, config check need nothing more). The DaemonSet runs the
# plugin as root: the kubelet's device-plugins and pod-resources directories are root-only (0750), the
# memory watchdog reads other pods' /proc and may SIGKILL them, and the MPS daemon needs the GPU devices.
USER 10001
EXPOSE 9410
ENTRYPOINT ["gpu-share", "run"]
