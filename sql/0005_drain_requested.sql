-- A drain requested for a node survives the node being declared dead and re-registering
-- from the same process (issue 9): the state column alone is overwritten by 'dead'.
ALTER TABLE placement_nodes ADD COLUMN IF NOT EXISTS drain_requested boolean NOT NULL DEFAULT false;
