"""One leader among the processes that campaign for an etcd key (the planner's replicas: one acts, the rest stand by).

The key is created under the campaigner's registration lease, and only where no one holds it (an etcd
transaction on its create revision being 0), so it lives exactly as long as the leader's lease: a leader that
stops cleanly revokes its lease and a standby takes over at its next round; one that is SIGKILLed or cut off
loses it when the lease's TTL runs out. There is no other hand-over and no fencing token: a leader cut off from
etcd stops leading at its next round (it cannot read the key), which is at most one round after a standby may
already have taken it. What the leader does each round must therefore be idempotent (the planner sets replica
counts; it never adds to them).
"""

from __future__ import annotations

import aetcd

from services.discovery.etcd import with_deadline
from services.discovery.registration import Registration


class Election:
    def __init__(self, key: str, registration: Registration) -> None:
        self.key = key.encode()
        self.registration = registration
        self.value = registration.info.worker_id.encode()

    async def campaign(self, client: aetcd.Client, timeout_s: float) -> str | None:
        """One round: take the key if no one holds it. Returns who holds it now (this process's worker id when
        it leads), or None when no one does that this process can tell (its own lease is not granted yet, or
        the key went between the two calls)."""
        lease = self.registration.lease_id
        if lease is not None and self.registration.registered:
            await with_deadline(
                client.transaction(
                    compare=[client.transactions.create(self.key) == 0],
                    success=[client.transactions.put(self.key, self.value, lease=lease)],
                    failure=[],
                ),
                timeout_s,
            )
        got = await with_deadline(client.get(self.key), timeout_s)
        if got is None:
            return None
        if got.value == self.value and got.lease != lease:
            # written under a lease of ours that has since expired: etcd deletes it with that lease
            return None
        return got.value.decode(errors="replace")

    def leads(self, holder: str | None) -> bool:
        return holder == self.value.decode()
