-- Ids of the workflow steps (chain steps, link callbacks) published after
-- the operation completed, so that a duplicate delivery does not publish
-- them again.
ALTER TABLE __SCHEMA__.records ADD COLUMN IF NOT EXISTS followups text[] NOT NULL DEFAULT '{}';
