# A stand-in for postgres:16 (see build.sh): Debian's PostgreSQL behind postgres-entrypoint.sh.
FROM local/debian-rootfs:bookworm
LABEL org.opencontainers.image.description="stand-in for postgres:16: Debian's PostgreSQL"
RUN ln -s "$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)" /usr/local/pgbin
ENV PATH=/usr/local/pgbin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PGDATA=/var/lib/postgresql/data \
    LANG=C.UTF-8
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
RUN chmod 755 /usr/local/bin/docker-entrypoint.sh
VOLUME /var/lib/postgresql/data
EXPOSE 5432
# A fast shutdown, as the official image's.
STOPSIGNAL SIGINT
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
