# The hospital-facing proxy (nginx.conf): Debian's nginx, run as an unprivileged user on a read-only root
# filesystem. Build context: this folder.
#   docker build -f docker/proxy.Dockerfile -t medflower-proxy docker
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends nginx \
    && rm -rf /var/lib/apt/lists/* /etc/nginx/sites-enabled/* \
    && useradd --no-create-home --uid 1000 --shell /usr/sbin/nologin fleetproxy
COPY nginx.conf /etc/nginx/medflower.conf
USER fleetproxy
CMD ["nginx", "-e", "stderr", "-c", "/etc/nginx/medflower.conf"]
