"""The README's mapping example on ``proj.celery``'s kit: every account gets 10 of credit
from tasks that a ``celery -A proj worker`` runs. Prints the balances and the audit rows
(JSON)."""

import json
import sys

import sqlalchemy as sa
from proj.celery import accounts, add_credit, audit, kit, metadata, notify

rows = int(sys.argv[1])
metadata.create_all(kit.store.engine)
with kit.store.engine.begin() as conn:
    conn.execute(accounts.insert(), [{"id": n, "balance": 0} for n in range(1, rows + 1)])

job = kit.map(
    accounts, add_credit, key="id", transactional=True, fanout=4, page_size=50, on_complete=notify
)
job.wait(timeout=float(sys.argv[2]))
with kit.store.engine.connect() as conn:
    balances = conn.execute(
        sa.select(accounts.c.balance, sa.func.count()).group_by(accounts.c.balance)
    ).all()
    audits = conn.execute(sa.select(audit.c.job, audit.c.rows)).all()
kit.close()
print(
    json.dumps(
        {
            "job": job.id,
            "balances": {str(balance): count for balance, count in balances},
            "audit": [list(row) for row in audits],
        }
    )
)
