# The dd_queue image used by compose.yaml: CPU torch by default. For GPU hosts build with
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# The package carries its service entry points (python -m dd_queue.services.*), the dashboard
# and the packaged configs (--config demo), so only the package is copied in. It runs as an
# unprivileged user; runs/ (and anything it writes) lives in that user's home.
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir "torch==2.13.0" --index-url "$TORCH_INDEX"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY dd_queue dd_queue
RUN pip install --no-cache-dir . && rm -rf /src \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin ddq
USER ddq
WORKDIR /home/ddq
ENV PYTHONUNBUFFERED=1
EXPOSE 8000
CMD ["ddq", "--help"]
