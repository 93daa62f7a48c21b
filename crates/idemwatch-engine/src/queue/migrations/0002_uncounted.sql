-- Returns that do not count toward max_deliveries (an outage, throttling, a lease
-- given back unhandled): a delivery's attempts are delivery_count - uncounted.
ALTER TABLE queue_messages ADD COLUMN uncounted INTEGER NOT NULL DEFAULT 0;
