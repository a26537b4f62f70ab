"""The README's ``proj/celery.py`` ("With Celery"), run by a clean install of
``shardkit[celery]``: its broker, store and queue come from the environment (the store is
a SQLite file, the cache the in-process one: no other extra), with the table and the
functions of the README's mapping example, which a worker imports by path."""

import os

import sqlalchemy as sa
from celery import Celery
from kombu import Exchange, Queue
from sqlalchemy import update

import shardkit
from shardkit.contrib.celery import CeleryExecutor

QUEUE = os.environ["README_QUEUE"]

app = Celery("proj", broker=os.environ["README_BROKER"])
# The test's own queue, which RabbitMQ drops two minutes after its last use.
app.conf.task_queues = [
    Queue(QUEUE, Exchange(QUEUE, auto_delete=True), routing_key=QUEUE, expires=120)
]
kit = shardkit.connect(
    store=os.environ["README_STORE"],
    cache="memory://",
    executor=CeleryExecutor(app, queue=QUEUE),
)

metadata = sa.MetaData()
accounts = sa.Table(
    "accounts",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("balance", sa.Integer, nullable=False),
)
audit = sa.Table("audit", metadata, sa.Column("job", sa.String(64)), sa.Column("rows", sa.Integer))


def add_credit(batch):  # batch.rows: the page's rows, in key order
    ids = [r["id"] for r in batch.rows]
    batch.conn.execute(
        update(accounts).where(accounts.c.id.in_(ids)).values(balance=accounts.c.balance + 10)
    )


def notify(done):  # once, in the transaction that completes the job
    done.conn.execute(audit.insert().values(job=done.job, rows=done.rows))
