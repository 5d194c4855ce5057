# The dd_queue image used by compose.yaml: CPU torch by default. For GPU hosts build with
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /app
RUN pip install --no-cache-dir "torch==2.13.0" --index-url "$TORCH_INDEX"
COPY pyproject.toml README.md ./
COPY dd_queue dd_queue
RUN pip install --no-cache-dir .
COPY services services
COPY config config
ENV PYTHONUNBUFFERED=1
EXPOSE 8000
CMD ["ddq", "--help"]
